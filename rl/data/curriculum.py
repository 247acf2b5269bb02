"""The RL trainer's prompt curriculum (`PromptCurriculum`, config.data.curriculum): uniform,
difficulty-raising, staged or online domain weights over its training entries, each pool of
entries read in epochs (grain: a fresh seeded permutation per epoch). The schedules it follows are
rl/data/schedules.py's. `state_dict()` / `load_state_dict(d)` restore the same decisions.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from rl.core.checks import allowed
from rl.data.schedules import (DifficultyCurriculum, OnlineAdaptation, StagedSchedule,
                               domain_counts, parse_stages)
from rl.data.templates import prompt_of
from rl.rewards import puzzles


CURRICULA = ("", "difficulty", "staged", "online")


def domain_of(entry: Mapping[str, Any]) -> str:
  """A generated puzzle's task, else a prompt record's domain."""
  return entry.get("task") or entry.get("domain", "math")


def check_curriculum(data: Any) -> None:
  """config.data's curriculum fields, as `PromptCurriculum` reads them (ValueError naming the
  field)."""
  allowed("data.curriculum", data.curriculum, CURRICULA)
  if data.curriculum == "difficulty" and data.source != "puzzles":
    raise ValueError("config.data.curriculum='difficulty' raises the level of generated "
                     "puzzles: it needs config.data.source='puzzles'")
  if data.curriculum == "staged":
    try:
      StagedSchedule(parse_stages(data.curriculum_stages))
    except ValueError as e:
      raise ValueError(f"config.data.curriculum_stages={data.curriculum_stages!r}: {e}") from None
  if not 0.0 < data.curriculum_threshold <= 1.0:
    raise ValueError(f"config.data.curriculum_threshold={data.curriculum_threshold}: must be in "
                     "(0, 1]")
  if data.curriculum_window < 1:
    raise ValueError(f"config.data.curriculum_window={data.curriculum_window}: must be >= 1")


def epoch_order(size: int, seed: int) -> grain.MapDataset:
  """Positions 0, 1, 2, ... -> indices into a pool of `size`: each block of `size` positions (an
  epoch) is a fresh permutation derived from `seed` (grain shuffles, then repeats endlessly), read
  by random access, so the order needs no state beyond how many positions were consumed."""
  return grain.MapDataset.range(size).shuffle(seed=seed).repeat()


class PromptCurriculum:
  """Which training entries each RL generation batch draws, per config.data.curriculum:

  * "": every entry once per epoch, in a fresh seeded permutation each epoch (`epoch_order`).
  * "difficulty" (generated puzzles): the same order over the task's entries; the level starts
    at config.data.difficulty and rises when the step accuracy averages >=
    curriculum_threshold over curriculum_window steps (`DifficultyCurriculum`); the training set
    is then generated afresh at the new level (its own seed; any prompt also in `exclude`, the
    held-out set, removed) and read from a new first epoch.
  * "staged": domain weights from config.data.curriculum_stages ("0:code=1;200:code=1,math=1",
    `StagedSchedule`); "online": weights from recent per-domain accuracy (`OnlineAdaptation`).
    Each batch takes `domain_counts` of each domain, each domain read in its own epochs, and
    interleaves them by a permutation seeded by (seed, step, generation batch).

  `draw` consumes positions of the epoch orders: the count consumed per pool is the draw state.
  `observe(entries, acc)` feeds a step's verifier accuracy of every sampled response (before any
  dynamic-sampling filter, which would bias it); `state_dict()` goes into the checkpoint's JSON
  record, so a resumed run draws exactly the prompts of an uninterrupted one.
  """

  def __init__(self, data: Any, entries: Sequence[Mapping[str, Any]], *, seed: int,
               exclude: Sequence[str] = ()):
    self.mode, self.seed = data.curriculum, seed
    if self.mode not in CURRICULA:
      raise ValueError(f"config.data.curriculum={self.mode!r}: must be one of {CURRICULA}")
    self.data = data
    self.exclude = set(exclude)
    self.entries = list(entries)
    self.schedule = self.adaptation = self.difficulty = None
    if self.mode == "difficulty":
      if data.source != "puzzles":
        raise ValueError("config.data.curriculum='difficulty' raises the level of generated "
                         "puzzles: it needs config.data.source='puzzles'")
      self.difficulty = DifficultyCurriculum.for_puzzles(
          [data.task], threshold=data.curriculum_threshold, window=data.curriculum_window,
          start={data.task: data.difficulty})
    elif self.mode == "staged":
      self.schedule = StagedSchedule(parse_stages(data.curriculum_stages))
    elif self.mode == "online":
      self.adaptation = OnlineAdaptation(sorted({domain_of(e) for e in self.entries}))
    self._index()

  def _index(self) -> None:
    """Pools of entry indices (one, "", without domain weights; else one per domain), each
    with its epoch order, read from its first position."""
    by_domain: dict[str, list[int]] = collections.defaultdict(list)
    for i, entry in enumerate(self.entries):
      by_domain[domain_of(entry)].append(i)
    self.by_domain = {d: np.asarray(v) for d, v in sorted(by_domain.items())}
    if self.schedule is not None:
      named = {d for _, weights in self.schedule.stages for d, w in weights.items() if w > 0}
      missing = sorted(named - set(self.by_domain))
      if missing:
        raise ValueError(f"config.data.curriculum_stages names domains {missing} without "
                         f"training entries (have {', '.join(self.by_domain)})")
    weighted = self.schedule is not None or self.adaptation is not None
    self.pools = dict(self.by_domain) if weighted else {"": np.arange(len(self.entries))}
    self.orders = {}
    for k, (name, pool) in enumerate(self.pools.items()):
      seed = int(np.random.SeedSequence([self.seed, k]).generate_state(1)[0])
      self.orders[name] = epoch_order(len(pool), seed)
    self.consumed = dict.fromkeys(self.pools, 0)

  def _take(self, pool: str, count: int) -> np.ndarray:
    start = self.consumed[pool]
    self.consumed[pool] += count
    order = self.orders[pool]
    return self.pools[pool][[order[k] for k in range(start, start + count)]]

  def _regenerate(self, level: int) -> None:
    fresh = puzzles.make(self.data.task, size=self.data.train_size,
                         seed=self.seed + 7919 * (level + 1), difficulty=level)
    self.entries = [e for e in fresh if prompt_of(e) not in self.exclude]
    if not self.entries:
      raise ValueError(f"{self.data.task} level {level}: every generated problem is held out")
    self._index()

  def weights(self, step: int) -> dict[str, float] | None:
    if self.schedule is not None:
      return self.schedule.weights(step)
    if self.adaptation is not None:
      return self.adaptation.weights()
    return None

  def draw(self, step: int, batch_index: int, size: int) -> np.ndarray:
    """Indices into `self.entries` of one generation batch of `size` prompts: the next ones of
    each pool's epoch order (see the class docstring)."""
    weights = self.weights(step)
    if weights is None:
      return self._take("", size)
    counts = domain_counts(weights, list(self.by_domain), size,
                           rng_seed=[self.seed, step, batch_index, 0])
    picked = np.concatenate([self._take(domain, count) for domain, count in counts.items()])
    return picked[np.random.default_rng([self.seed, step, batch_index, 1]).permutation(size)]

  def observe(self, step: int, entries: Sequence[Mapping[str, Any]],
              acc: np.ndarray) -> dict[str, float]:
    """Folds in step `step`'s accuracies; returns curriculum metrics (the level, or the domain
    weights this step drew by)."""
    acc = np.asarray(acc, np.float64)
    domains = np.array([domain_of(e) for e in entries])
    per_domain = {d: float(acc[domains == d].mean()) for d in sorted(set(domains.tolist()))}
    metrics = {f"curriculum/weight/{d}": w for d, w in (self.weights(step) or {}).items()}
    if self.difficulty is not None:
      if self.difficulty.update({self.data.task: per_domain[self.data.task]}):
        self._regenerate(self.difficulty.level(self.data.task))
      metrics["curriculum/level"] = float(self.difficulty.level(self.data.task))
    if self.adaptation is not None:
      self.adaptation.update(per_domain)
    return metrics

  def state_dict(self) -> dict[str, Any]:
    state: dict[str, Any] = {"mode": self.mode, "consumed": dict(self.consumed)}
    if self.difficulty is not None:
      state["difficulty"] = self.difficulty.state_dict()
    if self.adaptation is not None:
      state["adaptation"] = self.adaptation.state_dict()
    return state

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    if state.get("mode", "") != self.mode:
      raise ValueError(f"the checkpoint's curriculum is {state.get('mode')!r}, the config's "
                       f"{self.mode!r}")
    if self.difficulty is not None:
      before = self.difficulty.level(self.data.task)
      self.difficulty.load_state_dict(state["difficulty"])
      if self.difficulty.level(self.data.task) != before:
        self._regenerate(self.difficulty.level(self.data.task))
    if self.adaptation is not None:
      self.adaptation.load_state_dict(state["adaptation"])
    self.consumed.update({pool: int(n) for pool, n in state.get("consumed", {}).items()
                          if pool in self.consumed})
