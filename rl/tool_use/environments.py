"""Agentic environments as <environment, tools, task, verifier> tuples, and two synthesised ones.

An `Environment` names the tools its episodes may call (rl/tool_use/calls.py), makes tasks from a
seed, verifies a final answer against a task, and carries a rubric for an optional generative
judge (rl/tool_use/reward.py). Its entries are the trainer's prompt records:
{"env": name, "prompt": question, "env_task": task data the tools and the verifier read}.

* "trip_planning": a synthesised travel database per task (flights, hotels) behind two query
  tools; the verifier checks the chosen flights and hotel against every constraint (route,
  days, hotel rating, total budget), so any feasible plan is correct.
* "code_math": number-theory questions that are easy with a code interpreter and tedious
  without; the `python` tool runs the model's program in the sandbox; exact-answer verifier.

`demonstration(entry)` gives an expert's assistant turns for a task (tool calls, then the
answer): the scripted policy of the tests, and SFT transcripts.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rl.core.checks import allowed, positive
from rl.tool_use import calls
from rl.tool_use.calls import ToolContext, ToolFailure, register_tool

@dataclasses.dataclass(frozen=True)
class Environment:
  name: str
  tools: tuple[str, ...]
  make_tasks: Callable[[int, int], list[dict[str, Any]]]  # (size, seed) -> [{"prompt", ...}]
  verify: Callable[[Mapping[str, Any], str], float]  # (task, final answer text) -> [0, 1]
  demonstrate: Callable[[Mapping[str, Any]], list[str]]  # task -> expert assistant turns
  instructions: str
  rubric: str  # what a generative judge checks (rl/tool_use/reward.py)


ENVIRONMENTS: dict[str, Environment] = {}


def register_environment(env: Environment) -> Environment:
  if env.name in ENVIRONMENTS:
    raise ValueError(f"environment {env.name!r} is already registered")
  unknown = [t for t in env.tools if t not in calls.TOOLS]
  if unknown:
    raise ValueError(f"environment {env.name!r} names unregistered tools {unknown}")
  ENVIRONMENTS[env.name] = env
  return env


def get(name: str) -> Environment:
  if name not in ENVIRONMENTS:
    raise ValueError(f"unknown tool environment {name!r}; known: {sorted(ENVIRONMENTS)}")
  return ENVIRONMENTS[name]


def check_tools(tools: Any, *, job: str) -> None:
  """config.tools' checker (the section rl/tool_use/episodes.py reads) for a run of config.job:
  ValueError naming the field."""
  if not tools.enabled:
    return
  if job != "rl":
    raise ValueError(f"config.tools.enabled=True with config.job={job!r}: tool-use episodes "
                     "run in the RL job only (job='rl')")
  names = [name.strip() for name in tools.environments.split(",") if name.strip()]
  if not names:
    raise ValueError("config.tools.environments: name at least one of "
                     f"{sorted(ENVIRONMENTS)} (comma-separated)")
  for name in names:
    allowed("tools.environments", name, sorted(ENVIRONMENTS))
  positive(tools, "tools", "max_turns", "max_tool_tokens", "timeout_s", "workers", "waves")
  if tools.warm_start_steps < 0:
    raise ValueError(f"config.tools.warm_start_steps={tools.warm_start_steps}: must be >= 0")
  if not 0.0 <= tools.judge_weight <= 1.0:
    raise ValueError(f"config.tools.judge_weight={tools.judge_weight}: must be in [0, 1]")
  if tools.judge_weight and not tools.judge_hf_dir:
    raise ValueError("config.tools.judge_weight > 0 needs config.tools.judge_hf_dir (a local "
                     "HF checkpoint of the generative judge)")


def make_entries(names: Sequence[str], size: int, seed: int) -> list[dict[str, Any]]:
  """`size` entries drawn round-robin from the named environments (each with its own seed)."""
  per_env = {name: get(name).make_tasks(-(-size // len(names)), seed * 1009 + i)
             for i, name in enumerate(names)}
  return [{"env": names[i % len(names)], **per_env[names[i % len(names)]][i // len(names)]}
          for i in range(size)]


def messages(entry: Mapping[str, Any]) -> list[dict[str, str]]:
  """The opening turns of an episode: system (instructions + tools) and the user's task."""
  env = get(entry["env"])
  system = f"{env.instructions}\n{calls.describe_tools(env.tools)}"
  return [{"role": "system", "content": system}, {"role": "user", "content": entry["prompt"]}]


def encode_prompt(entry: Mapping[str, Any], tokenizer) -> list[int]:
  return list(tokenizer.apply_chat_template(messages(entry), add_generation_prompt=True))


def demonstration(entry: Mapping[str, Any]) -> list[str]:
  return get(entry["env"]).demonstrate(entry["env_task"])


# ----------------------------------------------------------------------------- Trip planning

CITIES = ("Lisbon", "Porto", "Madrid", "Paris", "Rome")


def _trip_task(rng: random.Random) -> dict[str, Any]:
  origin, destination = rng.sample(CITIES, 2)
  day, nights = rng.randint(1, 5), rng.randint(1, 3)
  back = day + nights
  flights, hotels = [], []

  def add_flight(src, dst, on_day):
    flights.append({"id": f"F{len(flights) + 1}", "origin": src, "destination": dst,
                    "day": on_day, "price": rng.randrange(40, 400, 5)})
  for _ in range(2):
    add_flight(origin, destination, day)
    add_flight(destination, origin, back)
  for _ in range(4):  # distractors: other routes and days
    src, dst = rng.sample(CITIES, 2)
    add_flight(src, dst, rng.randint(1, 8))
  min_rating = rng.choice((3, 4))
  for i in range(5):
    city = destination if i < 3 else rng.choice(CITIES)
    rating = min_rating if i == 0 else rng.randint(2, 5)
    hotels.append({"id": f"H{i + 1}", "city": city, "rating": rating,
                   "price_per_night": rng.randrange(30, 200, 5)})
  rng.shuffle(flights)
  rng.shuffle(hotels)
  task = {"origin": origin, "destination": destination, "day": day, "nights": nights,
          "min_rating": min_rating, "flights": flights, "hotels": hotels}
  best = _cheapest_plan(task)
  task["budget"] = best[0] + rng.randrange(0, 60, 5)
  prompt = (f"Trip {origin} to {destination}: out on day {day}, {nights} night(s) in a hotel "
            f"rated >= {min_rating}, back on day {back}, budget {task['budget']} EUR. End "
            "with 'Answer: <outbound flight> <return flight> <hotel>'.")
  return {"prompt": prompt, "env_task": task}


def _plan_cost(task: Mapping[str, Any], outbound: str, inbound: str, hotel: str) -> int | None:
  """Total price of a plan, or None when it breaks a constraint other than the budget."""
  flights = {f["id"]: f for f in task["flights"]}
  hotels = {h["id"]: h for h in task["hotels"]}
  out, back, stay = flights.get(outbound), flights.get(inbound), hotels.get(hotel)
  if out is None or back is None or stay is None:
    return None
  day = task["day"]
  if (out["origin"], out["destination"], out["day"]) != (task["origin"], task["destination"], day):
    return None
  if (back["origin"], back["destination"], back["day"]) != (
      task["destination"], task["origin"], day + task["nights"]):
    return None
  if stay["city"] != task["destination"] or stay["rating"] < task["min_rating"]:
    return None
  return out["price"] + back["price"] + stay["price_per_night"] * task["nights"]


def _cheapest_plan(task: Mapping[str, Any]) -> tuple[int, str, str, str]:
  plans = [(_plan_cost(task, a["id"], b["id"], h["id"]), a["id"], b["id"], h["id"])
           for a in task["flights"] for b in task["flights"] for h in task["hotels"]]
  return min(p for p in plans if p[0] is not None)


def _verify_trip(task: Mapping[str, Any], answer: str) -> float:
  parts = answer.replace(",", " ").split()
  if len(parts) != 3:
    return 0.0
  cost = _plan_cost(task, *parts)
  return float(cost is not None and cost <= task["budget"])


def _demonstrate_trip(task: Mapping[str, Any]) -> list[str]:
  cost, outbound, inbound, hotel = _cheapest_plan(task)
  back = task["day"] + task["nights"]
  return [
      "<think>Outbound.</think>" + calls.render_call(
          "find_flights", {"origin": task["origin"], "destination": task["destination"],
                           "day": task["day"]}),
      "<think>Return.</think>" + calls.render_call(
          "find_flights", {"origin": task["destination"], "destination": task["origin"],
                           "day": back}),
      "<think>Hotels.</think>" + calls.render_call(
          "find_hotels", {"city": task["destination"], "min_rating": task["min_rating"]}),
      f"<think>Cheapest: {cost} <= {task['budget']} EUR.</think>"
      f"Answer: {outbound} {inbound} {hotel}",
  ]


@register_tool("find_flights", "flights on one day, with prices",
               {"origin": "city", "destination": "city", "day": "day number"})
def find_flights(ctx: ToolContext, origin: str, destination: str, day: int) -> Any:
  day = int(day)
  found = [f"{f['id']} {f['price']} EUR" for f in ctx.task["flights"]
           if (f["origin"], f["destination"], f["day"]) == (origin, destination, day)]
  return "; ".join(found) or f"no flights from {origin} to {destination} on day {day}"


@register_tool("find_hotels", "hotels rated >= min_rating, with prices",
               {"city": "city", "min_rating": "1-5"})
def find_hotels(ctx: ToolContext, city: str, min_rating: int = 1) -> Any:
  if city not in CITIES:
    raise ToolFailure(f"find_hotels: unknown city {city!r}; cities: {', '.join(CITIES)}")
  found = [f"{h['id']} rating {h['rating']} {h['price_per_night']} EUR/night"
           for h in ctx.task["hotels"] if h["city"] == city and h["rating"] >= int(min_rating)]
  return "; ".join(found) or f"no hotels in {city} rated {min_rating} or more"


register_environment(Environment(
    name="trip_planning",
    tools=("find_flights", "find_hotels"),
    make_tasks=lambda size, seed: [_trip_task(random.Random(seed * 100_003 + i))
                                   for i in range(size)],
    verify=_verify_trip,
    demonstrate=_demonstrate_trip,
    instructions="You plan trips with a travel database.",
    rubric="The plan uses only flights and hotels returned by the tools and explains why it "
           "meets the budget."))


# ----------------------------------------------------------------------------- Code maths

def _math_task(rng: random.Random) -> dict[str, Any]:
  kind = rng.randrange(3)
  if kind == 0:
    base, power = rng.randint(2, 9), rng.randint(20, 60)
    prompt = f"What is the sum of the decimal digits of {base}^{power}?"
    code = f"print(sum(int(d) for d in str({base} ** {power})))"
    answer = sum(int(d) for d in str(base ** power))
  elif kind == 1:
    limit = rng.randrange(1000, 20000, 100)
    prompt = f"How many prime numbers are smaller than {limit}?"
    code = (f"print(sum(all(k % d for d in range(2, int(k ** 0.5) + 1)) "
            f"for k in range(2, {limit})))")
    sieve = [True] * limit
    for i in range(2, int(limit ** 0.5) + 1):
      if sieve[i]:
        sieve[i * i::i] = [False] * len(range(i * i, limit, i))
    answer = sum(sieve[2:])
  else:
    index = rng.randint(100, 500)
    prompt = f"What are the last four digits of the {index}-th Fibonacci number (F1 = F2 = 1)?"
    code = f"a, b = 0, 1\nfor _ in range({index}):\n  a, b = b, a + b\nprint(a % 10000)"
    a, b = 0, 1
    for _ in range(index):
      a, b = b, a + b
    answer = a % 10000
  prompt += " Use python, then end with 'Answer: <integer>'."
  return {"prompt": prompt, "env_task": {"answer": answer, "code": code}}


def _verify_math(task: Mapping[str, Any], answer: str) -> float:
  try:
    return float(int(answer.strip().rstrip(".")) == task["answer"])
  except ValueError:
    return 0.0


register_environment(Environment(
    name="code_math",
    tools=("python",),
    make_tasks=lambda size, seed: [_math_task(random.Random(seed * 100_003 + i))
                                   for i in range(size)],
    verify=_verify_math,
    demonstrate=lambda task: [
        "<think>I will compute it exactly with Python.</think>"
        + calls.render_call("python", {"code": task["code"]}),
        f"Answer: {task['answer']}"],
    instructions="You solve maths questions with a code interpreter.",
    rubric="The answer is computed by a program rather than guessed, and the final line gives "
           "one integer."))
