"""Multi-turn tool-use rollouts: generation pauses at each tool call, the host runs the tool and
appends its result (response_mask 0), and generation resumes, up to a turn limit.

An episode is a list of segments (rl/tool_use/context.py): the prompt, then alternating assistant
(sampled, mask 1, sampler log-probs kept) and tool (host-written, mask 0) segments. One engine
round continues every generating episode of a wave from its visible context (the rule of
context.py: reasoning kept across tool results) until a final stop id, the tool-call stop id,
or its token budget:

  final stop (eos, <|im_end|>)    the episode ends ("answer")
  tool-call stop, turn ends with  the call goes to the thread pool (rl/tool_use/calls.py) and the
    </tool_call>                  episode waits; past `max_turns` calls it ends ("turn_limit")
  tool-call stop, no marker       a `>` in text or the opening <tool_call> (byte tokenizer): it
                                  continues next round
  budget spent                    the episode ends ("length"; `truncated`)

What overlaps. Episodes are split into `waves` (default 2) that take turns: while wave A's tool
calls run in the pool, wave B decodes, and vice versa, so tool latency hides behind the other
wave's decoding; within a wave all calls of a round run concurrently. Waiting happens only when a
wave's calls outlast the other wave's round. With `waves=1` every round decodes all episodes and
then waits for all their calls (concurrent with each other, not with decoding). The price of
waves is smaller engine batches: they pay where a round's time grows with its batch (CPU), and
cost where decoding is latency-bound (a large accelerator batch), where `waves=1` is better.

RNG: episode n samples from fold_in(rng, uid n) at index = its policy tokens so far, so the
draws do not depend on wave or round boundaries. A resumed episode is re-prefilled, so its KV
cache always holds the current weights' keys and values.

The result follows the `Trajectories` layout: prompt, then the episode (assistant and tool
tokens interleaved), then padding, width prompt bucket + `max_new_tokens` + `max_turns` *
`max_tool_tokens`. keep-routing takes the routing of each episode's last engine round (which
processed the whole episode); keep-sampling-mask the kept sets of its sampled tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from models.padding import round_up
from models.tokenizer import pad_batch
from rl.rollout import engine as rollout_lib
from rl.tool_use import calls, environments
from rl.tool_use.context import Segment, visible_ids
from rl.core.types import Trajectories

# (context ids [N, W], context lens [N], uids [N], generated_before [N], max_new [N]) ->
# {"tokens" [N, W + M], "logp_old", "new_count" [N], "stopped" [N], optional "routing",
# "kept_ids"}: the contract of rl.rollout.engine.run_engine with the stop ids bound.
GenerateFn = Callable[..., Mapping[str, Any]]


@dataclasses.dataclass(frozen=True)
class ToolRolloutConfig:
  max_new_tokens: int  # policy tokens per episode, over all its turns
  max_turns: int  # tool calls per episode; one more ends it
  max_tool_tokens: int  # tokens of one tool result, wrapper included (longer ones are cut)
  waves: int = 2
  prompt_bucket: int = 16
  pad_id: int = 0

  def __post_init__(self):
    for name in ("max_new_tokens", "max_turns", "max_tool_tokens", "waves", "prompt_bucket"):
      if getattr(self, name) <= 0:
        raise ValueError(f"ToolRolloutConfig.{name}={getattr(self, name)}: must be positive")

  @property
  def episode_width(self) -> int:
    return self.max_new_tokens + self.max_turns * self.max_tool_tokens


@dataclasses.dataclass
class Episode:
  uid: int
  entry: Mapping[str, Any]
  segments: list[Segment]
  generated: int = 0  # policy tokens so far (budget, RNG index)
  tool_calls: int = 0
  tool_errors: int = 0
  tool_wall_s: float = 0.0
  status: str = "generating"  # "generating", "waiting" (a call in flight) or "done"
  end: str = ""  # once done: "answer", "length" or "turn_limit"
  pending: Any = None
  routing: np.ndarray | None = None  # [episode tokens, layers, k] of the last engine round
  kept_ids: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)

  @property
  def turns(self) -> int:
    """Assistant turns: one per tool call, plus the final one unless the episode was cut."""
    return self.tool_calls + (self.end == "answer")

  def info(self) -> dict[str, Any]:
    return {"end": self.end, "turns": self.turns, "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors, "tool_wall_s": self.tool_wall_s}


def _turn(ep: Episode) -> Segment:
  """The open assistant segment (a new one after the prompt or a tool result)."""
  if ep.segments[-1].role != "assistant":
    ep.segments.append(Segment("assistant", []))
  return ep.segments[-1]


class ToolRollout:
  """Runs tool-use episodes for entries of rl/tool_use/environments.py; see the module docstring."""

  def __init__(self, tokenizer, cfg: ToolRolloutConfig, runner: calls.ToolRunner):
    self.tokenizer = tokenizer
    self.cfg = cfg
    self.runner = runner
    self.call_stop_id = calls.call_stop_id(tokenizer)
    self.final_ids = frozenset(int(i) for i in tokenizer.stop_ids)
    self.result_prefix = tokenizer.encode(calls.RESULT_PREFIX)
    self.result_suffix = tokenizer.encode(calls.RESULT_SUFFIX)
    if len(self.result_prefix) + len(self.result_suffix) >= cfg.max_tool_tokens:
      raise ValueError(f"max_tool_tokens={cfg.max_tool_tokens} leaves no room for a result: "
                       f"the wrapper alone takes "
                       f"{len(self.result_prefix) + len(self.result_suffix)} tokens")

  def engine_generate(self, graphdef, state, rng, engine_cfg: rollout_lib.RolloutConfig,
                      rows: int) -> GenerateFn:
    """`GenerateFn` backed by the rollout engine; `rows` fixes the batch (one compilation)."""
    engine_cfg = engine_cfg.replace(batch_size=rows, max_prompt_len=0)
    graphdef, state = rollout_lib.decode_weights(graphdef, state)  # once for all the waves

    def generate(ids, lens, uids, generated_before, max_new):
      out = rollout_lib.run_engine(
          graphdef, state, ids, lens, rng, engine_cfg, uids=uids,
          generated_before=generated_before, max_new=max_new,
          new_tokens=self.cfg.max_new_tokens, rows=rows,
          stop_ids=[[self.call_stop_id]] * len(ids))
      keep = ("tokens", "logp_old", "new_count", "stopped", "routing", "kept_ids")
      return jax.device_get({k: v for k, v in out.items() if k in keep})
    return generate

  def wave_rows(self, num_episodes: int) -> int:
    """Engine rows per wave: the largest wave rounded up to a power of two."""
    largest = -(-num_episodes // min(self.cfg.waves, num_episodes))
    return 1 << max(largest - 1, 0).bit_length()

  # ---------------------------------------------------------------------- Episodes
  def run(self, prompts: Sequence[Sequence[int]], entries: Sequence[Mapping[str, Any]],
          generate: GenerateFn, *, group_id: Sequence[int], policy_version: int = 0,
          prompt_width: int = 0) -> tuple[Trajectories, list[dict[str, Any]]]:
    """Runs one episode per (prompt, entry) to the end; returns Trajectories and per-episode
    info (end, turns, tool_calls, tool_errors, tool_wall_s). `prompt_width` > 0 fixes the
    prompt part of every row (one compiled engine whatever the batch's prompts); 0 rounds the
    longest prompt up to `prompt_bucket`."""
    if len(prompts) != len(entries) or not prompts:
      raise ValueError(f"{len(prompts)} prompts for {len(entries)} entries")
    episodes = [Episode(uid, entry, [Segment("prompt", list(prompt))])
                for uid, (prompt, entry) in enumerate(zip(prompts, entries))]
    longest = max(len(p) for p in prompts)
    if prompt_width and longest > prompt_width:
      raise ValueError(f"a prompt of {longest} tokens exceeds prompt_width={prompt_width}")
    prompt_width = prompt_width or round_up(longest, self.cfg.prompt_bucket)
    context_width = prompt_width + self.cfg.episode_width
    waves = [episodes[i::self.cfg.waves] for i in range(min(self.cfg.waves, len(episodes)))]
    while any(ep.status != "done" for ep in episodes):
      for wave in waves:
        for ep in wave:
          if ep.status == "waiting":
            self._append_result(ep, self.runner.result(ep.pending))
        active = [ep for ep in wave if ep.status == "generating"]
        if active:
          self._round(active, generate, context_width)
    return self._trajectories(episodes, prompt_width, group_id, policy_version), [
        ep.info() for ep in episodes]

  def _round(self, active: list[Episode], generate: GenerateFn, context_width: int) -> None:
    contexts = [visible_ids(ep.segments, self.tokenizer) for ep in active]
    ids, lens = pad_batch(contexts, length=context_width, pad_id=self.cfg.pad_id)
    out = generate(ids, lens, np.array([ep.uid for ep in active], np.int32),
                   np.array([ep.generated for ep in active], np.int32),
                   np.array([self.cfg.max_new_tokens - ep.generated for ep in active], np.int32))
    for i, ep in enumerate(active):
      start, count = int(lens[i]), int(out["new_count"][i])
      new = [int(t) for t in out["tokens"][i, start:start + count]]
      turn = _turn(ep)
      turn.ids += new
      turn.logp += [float(x) for x in out["logp_old"][i, start:start + count]]
      ep.generated += count
      if out.get("routing") is not None:
        ep.routing = np.asarray(out["routing"][i, :start + count])
      if out.get("kept_ids") is not None:
        ep.kept_ids.append((start, np.asarray(out["kept_ids"][i, start:start + count])))
      self._after_round(ep, turn, bool(out["stopped"][i]) and count > 0)

  def _after_round(self, ep: Episode, turn: Segment, stopped: bool) -> None:
    last = turn.ids[-1] if turn.ids else None
    if stopped and last in self.final_ids:
      ep.status, ep.end = "done", "answer"
    elif ep.generated >= self.cfg.max_new_tokens:
      ep.status, ep.end = "done", "length"
    elif stopped and last == self.call_stop_id:
      text = self.tokenizer.decode(turn.ids, skip_special=False)
      if not calls.ends_with_call(text):
        return  # a `>` in ordinary text: keep generating
      if ep.tool_calls >= self.cfg.max_turns:
        ep.status, ep.end = "done", "turn_limit"
        return
      env = environments.get(ep.entry["env"])
      ep.pending = self.runner.submit(text, env.tools, ep.entry["env_task"])
      ep.tool_calls += 1
      ep.status = "waiting"

  def _append_result(self, ep: Episode, result: calls.ToolResult) -> None:
    room = self.cfg.max_tool_tokens - len(self.result_prefix) - len(self.result_suffix)
    body = self.tokenizer.encode(result.text)[:room]
    ep.segments.append(Segment("tool", self.result_prefix + body + self.result_suffix))
    ep.tool_errors += int(result.error)
    ep.tool_wall_s += result.wall_s
    ep.pending = None
    ep.status = "generating"

  # ---------------------------------------------------------------------- Trajectories
  def _trajectories(self, episodes: list[Episode], prompt_width: int, group_id: Sequence[int],
                    policy_version: int) -> Trajectories:
    n, width = len(episodes), prompt_width + self.cfg.episode_width
    tokens = np.full((n, width), self.cfg.pad_id, np.int32)
    response_mask = np.zeros((n, width), np.int32)
    logp_old = np.zeros((n, width), np.float32)
    routing = kept_ids = None
    first = next((ep for ep in episodes if ep.routing is not None), None)
    if first is not None:
      k = first.routing.shape[-1]
      routing = np.broadcast_to(np.arange(k, dtype=np.int32),
                                (n, width, *first.routing.shape[1:])).copy()
    first = next((ep for ep in episodes if ep.kept_ids), None)
    if first is not None:
      # Positions the sampler did not draw hold no ids (-1): they keep every id, as in
      # rl.core.sampling.
      kept_ids = np.full((n, width, first.kept_ids[0][1].shape[-1]), -1, np.int32)
    for row, ep in enumerate(episodes):
      position = 0
      for segment in ep.segments:
        end = position + len(segment.ids)
        tokens[row, position:end] = segment.ids
        if segment.role == "assistant":
          response_mask[row, position:end] = 1
          logp_old[row, position:end] = segment.logp
        position = end
      if routing is not None and ep.routing is not None:
        routing[row, :len(ep.routing)] = ep.routing
      for start, kept in ep.kept_ids:
        kept_ids[row, start:start + len(kept)] = kept
    ends = np.array([ep.end for ep in episodes])
    return Trajectories(
        tokens=tokens, prompt_lens=np.array([len(ep.segments[0].ids) for ep in episodes],
                                            np.int32),
        response_mask=response_mask, logp_old=logp_old,
        policy_version=np.full((n, width), policy_version, np.int32),
        group_id=np.asarray(group_id, np.int32), finished=ends == "answer",
        truncated=ends == "length", routing=routing, kept_ids=kept_ids)
