"""Verifiable puzzle tasks: generated prompts with gold answers, scored by our own verifiers.

Contract (what the data pipeline and the curriculum use):

* `make(task, *, size, seed, difficulty=None) -> list[dict]`: `size` entries, each a JSON-ready
  dict with "question", "answer" (one gold answer), "task", "difficulty" and the fields its
  verifier reads. The same (task, size, seed, difficulty) gives the same entries in any process.
* `score(entry, response) -> float`: 1.0 when the response's final answer solves the entry, else
  0.0. Never raises on model output.
* `TASKS[name]`: `levels` (difficulty runs over `range(levels)`; None means 0) and `difficulty`,
  a sentence saying what the knob changes, for the curriculum.

Generators. "arithmetic" and "addition" are ours (short "12+7*3=" / "58+67=" prompts with a plain
integer answer; the demo's tiny model learns "addition"). The other tasks use reasoning-gym
0.1.25's generators, each difficulty level mapped to one generator config. reasoning-gym seeds
item i with `seed + i`, so neighbouring seeds would share all but one item; every generator gets
a hash of (task, level, seed) instead.

Verifiers: our own, one per task, in puzzle_verifiers.py (its docstring says why reasoning-gym's
scorers are not used and what each one checks).

Answer extraction (`extract.puzzle_answer`): the last complete `\\boxed{..}` (read as the math
reward reads it, so \\fbox and escaped braces count), else the text after the last "Answer:",
else the whole response; surrounding whitespace, `*` and backticks are stripped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Callable
from typing import Any

from rl.rewards import extract
from rl.rewards import puzzle_verifiers as verifiers

# ---------------------------------------------------------------------------------------------
# Generators, one section per task
# ---------------------------------------------------------------------------------------------

def _derived_seed(*parts: Any) -> int:
  """A 31-bit seed from (task, level, seed) that is the same in every process."""
  digest = hashlib.sha256(repr(parts).encode()).digest()
  return int.from_bytes(digest[:4], "big") >> 1


def _reasoning_gym_items(name: str, config: dict, size: int, seed: int) -> list[dict]:
  # Imported here: reasoning-gym takes about a second to import and only its generators are used,
  # so a run that trains on "arithmetic" alone never loads it.
  import reasoning_gym  # pylint: disable=import-outside-toplevel

  dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **config)
  return [dataset[i] for i in range(size)]


# Arithmetic (ours). Level d: 2 + d // 2 operands of up to 1 + (d + 1) // 2 digits; level 0 adds
# only, level 1 also subtracts, level 2 and up also multiply (precedence as in Python).
def _arithmetic_shape(level: int) -> tuple[int, int, str]:
  operators = "+" if level == 0 else "+-" if level == 1 else "+-*"
  return 2 + level // 2, 1 + (level + 1) // 2, operators


def _make_arithmetic(size: int, seed: int, level: int) -> list[dict]:
  return _expressions(size, seed, *_arithmetic_shape(level))


def _make_addition(size: int, seed: int, level: int) -> list[dict]:
  """Level d: a + b with a, b of up to 2 + d digits."""
  return _expressions(size, seed, 2, 2 + level, "+")


def _expressions(size: int, seed: int, num_operands: int, digits: int,
                 operators: str) -> list[dict]:
  rng = random.Random(seed)
  entries = []
  for _ in range(size):
    operands = [str(rng.randint(0, 10**digits - 1)) for _ in range(num_operands)]
    expression = operands[0]
    for operand in operands[1:]:
      expression += rng.choice(operators) + operand
    answer = str(verifiers.evaluate_expression(expression).value.numerator)
    entries.append({"question": f"{expression}=", "answer": answer, "expression": expression,
                    "solution": _worked_solution(answer)})
  return entries


def _worked_solution(answer: str) -> str:
  """The worked solution of the SFT cold start: the digits from the ones place up (the order
  in which column arithmetic produces them), then the answer."""
  reversed_digits = answer.lstrip("-")[::-1] + ("-" if answer.startswith("-") else "")
  return f"{reversed_digits} Answer: {answer}"


def _uncarried(x: int, y: int, op: str) -> int:
  """x op y (x, y >= 0; op "+" or "-") worked column by column with every carry or borrow
  forgotten: each column's digit is (x_i op y_i) mod 10, and an addition's top column keeps its
  overflow. x - y with x < y is -(y - x) worked the same way."""
  if op == "-" and x < y:
    return -_uncarried(y, x, "-")
  digits, place, result = max(len(str(x)), len(str(y))), 1, 0
  for i in range(digits):
    a, b = x // 10**i % 10, y // 10**i % 10
    column = a + b if op == "+" else a - b
    result += (column % 10) * place
    if op == "+" and i == digits - 1 and column >= 10:
      result += place * 10
    place *= 10
  return result


def with_carry_slips(entries: list[dict], rate: float, seed: int) -> list[dict]:
  """The worked solutions of an imperfect teacher, for an SFT cold start: of the two-operand
  + / - problems whose column arithmetic needs a carry or a borrow, a `rate` fraction (drawn
  with `seed`) get the solution written with every carry forgotten (`_uncarried`), as a weak
  model's distilled demonstrations would. Questions and gold answers are untouched: the
  verifier still checks the true value, so RL can learn what imitation could not."""
  rng = random.Random(seed)
  out = []
  for entry in entries:
    match = re.fullmatch(r"(\d+)([+-])(\d+)", entry.get("expression", ""))
    if match is None:
      raise ValueError(f"carry slips need two-operand + / - arithmetic, got {entry!r:.80}")
    x, op, y = int(match[1]), match[2], int(match[3])
    slipped = _uncarried(x, y, op)
    if slipped != int(entry["answer"]) and rng.random() < rate:
      entry = {**entry, "solution": _worked_solution(str(slipped))}
    out.append(entry)
  return out


# Puzzle 24.
_PUZZLE24_LEVELS = (
    {"min_value": 1, "max_value": 6, "operators": ("+", "-", "*")},
    {"min_value": 1, "max_value": 9, "operators": ("+", "-", "*")},
    {"min_value": 1, "max_value": 10, "operators": ("+", "-", "*", "/")},
)


def _make_puzzle24(size: int, seed: int, level: int) -> list[dict]:
  config = _PUZZLE24_LEVELS[level]
  entries = []
  for item in _reasoning_gym_items("puzzle24", config, size, seed):
    numbers = [int(n) for n in item["metadata"]["numbers"]]
    operators = list(config["operators"])
    question = (f"Make 24 using each of the numbers {', '.join(map(str, numbers))} exactly once, "
                f"with the operators {' '.join(operators)} and parentheses. Give the expression "
                "as your final answer.")
    entries.append({"question": question, "answer": item["answer"], "numbers": numbers,
                    "target": 24, "operators": operators})
  return entries


# Countdown. The question is ours: reasoning-gym's templates disagree with each other ("using all"
# vs "at most once"); ours says "each at most once" and the verifier enforces exactly that.
_COUNTDOWN_LEVELS = (
    {"min_numbers": 3, "max_numbers": 3, "min_value": 1, "max_value": 20, "min_target": 10,
     "max_target": 100, "operators": ("+", "-", "*")},
    {"min_numbers": 4, "max_numbers": 4, "min_value": 1, "max_value": 50, "min_target": 50,
     "max_target": 500, "operators": ("+", "-", "*")},
    {"min_numbers": 4, "max_numbers": 5, "min_value": 1, "max_value": 100, "min_target": 100,
     "max_target": 999},
    {"min_numbers": 5, "max_numbers": 6, "min_value": 1, "max_value": 100, "min_target": 100,
     "max_target": 999},
    {"min_numbers": 6, "max_numbers": 8, "min_value": 1, "max_value": 100, "min_target": 100,
     "max_target": 9999},
)


def _make_countdown(size: int, seed: int, level: int) -> list[dict]:
  config = _COUNTDOWN_LEVELS[level]
  operators = list(config.get("operators", ("+", "-", "*", "/")))
  entries = []
  for item in _reasoning_gym_items("countdown", config, size, seed):
    numbers = [int(n) for n in item["metadata"]["numbers"]]
    target = int(item["metadata"]["target"])
    question = (f"Using the numbers {', '.join(map(str, numbers))}, make {target}. Each number may "
                f"be used at most once (you need not use them all), with the operators "
                f"{' '.join(operators)} and parentheses. Give the expression as your final answer.")
    entries.append({"question": question, "answer": item["answer"], "numbers": numbers,
                    "target": target, "operators": operators})
  return entries


# Maze: minimum number of steps, 4-connected.
_MAZE_LEVELS = tuple(
    {"min_dist": d0, "max_dist": d1, "min_grid_size": g0, "max_grid_size": g1}
    for (d0, d1), (g0, g1) in (((1, 3), (5, 6)), ((3, 6), (6, 8)), ((5, 10), (7, 10)),
                               ((10, 15), (10, 15)), ((15, 25), (15, 25))))


def _make_maze(size: int, seed: int, level: int) -> list[dict]:
  entries = []
  for item in _reasoning_gym_items("maze", _MAZE_LEVELS[level], size, seed):
    meta = item["metadata"]
    fields = {"grid": list(meta["grid"]), "start": meta["start"], "goal": meta["goal"],
              "wall": meta["wall"]}
    if str(verifiers.maze_distance(**fields)) != item["answer"]:
      raise RuntimeError(f"maze generator's distance {item['answer']} disagrees with our BFS")
    entries.append({"question": item["question"], "answer": item["answer"], **fields})
  return entries


# Sudoku (9x9) and mini sudoku (4x4): any valid completion of the clues counts.
_SUDOKU_LEVELS = tuple({"min_empty": lo, "max_empty": hi}
                       for lo, hi in ((10, 20), (20, 30), (30, 40), (40, 50), (50, 54)))
_MINI_SUDOKU_LEVELS = tuple({"min_empty": lo, "max_empty": hi}
                            for lo, hi in ((4, 6), (6, 8), (8, 10), (10, 12)))


def _sudoku_maker(rg_name: str, levels: tuple[dict, ...]) -> Callable[[int, int, int], list]:
  def make_entries(size: int, seed: int, level: int) -> list[dict]:
    return [{"question": item["question"], "answer": item["answer"],
             "puzzle": [[int(v) for v in row] for row in item["metadata"]["puzzle"]]}
            for item in _reasoning_gym_items(rg_name, levels[level], size, seed)]
  return make_entries


# Knights and knaves: one role per inhabitant; `make` keeps only puzzles with a unique solution.
_KNIGHTS_KNAVES_LEVELS = tuple(
    {"n_people": n, "depth_constraint": depth, "width_constraint": width}
    for n, depth, width in ((2, 2, 2), (3, 2, 2), (4, 2, 2), (5, 3, 2), (6, 3, 3)))


def _as_lists(tree: Any) -> Any:
  return [_as_lists(x) for x in tree] if isinstance(tree, (tuple, list)) else tree


def _make_knights_knaves(size: int, seed: int, level: int) -> list[dict]:
  entries = []
  for item in _reasoning_gym_items("knights_knaves", _KNIGHTS_KNAVES_LEVELS[level], size, seed):
    meta = item["metadata"]
    statements = _as_lists(meta["statements"])
    solution = [bool(x) for x in meta["solution"]]
    if verifiers.knights_knaves_solutions(statements) != [tuple(solution)]:
      raise RuntimeError("knights_knaves generator produced a puzzle without a unique solution")
    terms = meta["knight_knave_terms"]
    entries.append({"question": item["question"], "answer": item["answer"],
                    "names": [str(n) for n in meta["names"]],
                    "roles": [str(terms["knight"]), str(terms["knave"])],
                    "statements": statements, "solution": solution})
  return entries


# Zebra puzzles: the question asks for one name from the generator's uniquely solvable grid.
_ZEBRA_LEVELS = tuple({"num_people": p, "num_characteristics": c}
                      for p, c in ((2, 2), (3, 3), (4, 3), (4, 4), (5, 4)))


def _make_zebra(size: int, seed: int, level: int) -> list[dict]:
  return [{"question": item["question"], "answer": str(item["answer"])}
          for item in _reasoning_gym_items("zebra_puzzles", _ZEBRA_LEVELS[level], size, seed)]


# N queens: complete the board to n mutually non-attacking queens, keeping the given ones.
_N_QUEENS_LEVELS = tuple({"n": n, "min_remove": lo, "max_remove": hi}
                         for n, lo, hi in ((4, 1, 2), (6, 2, 4), (8, 3, 6), (8, 6, 8), (10, 6, 10)))


def _make_n_queens(size: int, seed: int, level: int) -> list[dict]:
  return [{"question": item["question"], "answer": item["answer"],
           "puzzle": ["".join(row) for row in item["metadata"]["puzzle"]]}
          for item in _reasoning_gym_items("n_queens", _N_QUEENS_LEVELS[level], size, seed)]


# Graph colouring: a JSON map from every vertex to an allowed colour, no edge monochrome.
_GRAPH_COLOR_LEVELS = tuple(
    {"min_num_vertices": lo, "max_num_vertices": hi, "edge_probability": p, "num_colors": 3}
    for lo, hi, p in ((4, 6, 0.3), (6, 10, 0.25), (10, 15, 0.2), (15, 20, 0.15), (20, 25, 0.12)))


def _make_graph_color(size: int, seed: int, level: int) -> list[dict]:
  entries = []
  for item in _reasoning_gym_items("graph_color", _GRAPH_COLOR_LEVELS[level], size, seed):
    puzzle = item["metadata"]["puzzle"]
    coloring = {str(v): int(c) for v, c in item["metadata"]["possible_answer"].items()}
    entries.append({"question": item["question"], "answer": json.dumps(coloring),
                    "vertices": [int(v) for v in puzzle["vertices"]],
                    "edges": [[int(u), int(v)] for u, v in puzzle["edges"]],
                    "colors": [int(c) for c in puzzle["color_options"]]})
  return entries


# ---------------------------------------------------------------------------------------------
# Registry and public entry points
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Task:
  name: str
  levels: int  # difficulty runs over range(levels)
  difficulty: str  # what raising the difficulty changes
  generate: Callable[[int, int, int], list[dict]]  # (size, seed, level) -> entries
  verify: Callable[[dict, str], bool]  # (entry, extracted answer) -> solved


TASKS: dict[str, Task] = {task.name: task for task in (
    Task("arithmetic", 8,
         "operands 2 + d//2 of up to 1 + (d+1)//2 digits; level 0 only +, level 1 adds -, "
         "level 2 and up add * (with precedence)", _make_arithmetic, verifiers.verify_arithmetic),
    Task("addition", 3, "two operands of up to 2, 3, 4 digits", _make_addition,
         verifiers.verify_arithmetic),
    Task("puzzle24", len(_PUZZLE24_LEVELS),
         "range of the four numbers (1-6, 1-9, 1-10) and operators (/ allowed from level 2)",
         _make_puzzle24, lambda e, a: verifiers.verify_expression(e, a, use_all=True)),
    Task("countdown", len(_COUNTDOWN_LEVELS),
         "count of numbers (3 -> 6-8), their range (1-20 -> 1-100), the target range "
         "(10-100 -> 100-9999), and / allowed from level 2",
         _make_countdown, lambda e, a: verifiers.verify_expression(e, a, use_all=False)),
    Task("maze", len(_MAZE_LEVELS),
         "shortest-path length (1-3 -> 15-25 steps) and grid side (5-6 -> 15-25)",
         _make_maze, verifiers.verify_maze),
    Task("sudoku", len(_SUDOKU_LEVELS),
         "empty cells of the 9x9 grid (10-20 -> 50-54)",
         _sudoku_maker("sudoku", _SUDOKU_LEVELS), verifiers.verify_sudoku),
    Task("mini_sudoku", len(_MINI_SUDOKU_LEVELS),
         "empty cells of the 4x4 grid (4-6 -> 10-12)",
         _sudoku_maker("mini_sudoku", _MINI_SUDOKU_LEVELS), verifiers.verify_sudoku),
    Task("knights_knaves", len(_KNIGHTS_KNAVES_LEVELS),
         "inhabitants (2 -> 6) and nesting depth / width of their statements (2/2 -> 3/3)",
         _make_knights_knaves, verifiers.verify_knights_knaves),
    Task("zebra", len(_ZEBRA_LEVELS),
         "houses x attributes (2x2, 3x3, 4x3, 4x4, 5x4)", _make_zebra, verifiers.verify_zebra),
    Task("n_queens", len(_N_QUEENS_LEVELS),
         "board side (4 -> 10) and queens left to place (1-2 -> 6-10)",
         _make_n_queens, verifiers.verify_n_queens),
    Task("graph_color", len(_GRAPH_COLOR_LEVELS),
         "vertices (4-6 -> 20-25) with 3 colours, edge probability falling (0.3 -> 0.12) so "
         "that a colouring exists", _make_graph_color, verifiers.verify_graph_color),
)}


def score(entry: dict, response: str) -> float:
  """1.0 when the response's final answer solves `entry`, else 0.0."""
  return 1.0 if TASKS[entry["task"]].verify(entry, extract.puzzle_answer(response)) else 0.0


def make(task: str, *, size: int, seed: int, difficulty: int | None = None) -> list[dict]:
  """`size` entries of `task` at `difficulty` (None: 0), the same for the same arguments.

  Every gold answer is checked with our own verifier: a generator bug fails here, not in training.
  """
  spec = TASKS[task]
  level = 0 if difficulty is None else difficulty
  if not 0 <= level < spec.levels:
    raise ValueError(f"{task}: difficulty {level} outside 0..{spec.levels - 1}")
  entries = []
  for fields in spec.generate(size, _derived_seed(task, level, seed), level):
    entry = {"task": task, "difficulty": level, **fields}
    if score(entry, entry["answer"]) != 1.0:
      raise RuntimeError(f"{task}: gold answer {entry['answer']!r} fails our verifier")
    entries.append(entry)
  return entries
