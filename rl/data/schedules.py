"""Domain and difficulty schedules of the RL curriculum (rl/data/curriculum.py reads them).

* `StagedSchedule`: fixed domain weights per stage of training (the RLHF data-scaling study
  trains on math and code, whose verifiers are reliable, before the full mix); `parse_stages`
  reads config.data.curriculum_stages.
* `OnlineAdaptation`: domain weights from recent per-domain accuracy (rule in its docstring).
* `DifficultyCurriculum`: one difficulty level per puzzle task, raised once the task's accuracy
  clears a threshold over a window.
* `domain_counts`: how many of a batch's prompts each domain gets under given weights.

Every schedule has `state_dict()` (JSON-serialisable, for the checkpoint's JSON record) and
`load_state_dict(d)`; one restored from a state makes the same decisions as the original.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from rl.core.checks import domain_values
from rl.rewards import puzzles


def _normalized(weights: Mapping[str, float], what: str) -> dict[str, float]:
  """`weights` scaled to sum to 1; ValueError on a negative, non-finite or all-zero weight."""
  for domain, weight in weights.items():
    if not math.isfinite(weight) or weight < 0:
      raise ValueError(f"{what}: weight of {domain!r} must be finite and >= 0, got {weight}")
  total = sum(weights.values())
  if total <= 0:
    raise ValueError(f"{what}: weights {dict(weights)} sum to zero")
  return {domain: weight / total for domain, weight in weights.items()}


# ----------------------------------------------------------------------------- Staged schedule

def _accuracy(name: str, value, known, what: str) -> float:
  """One accuracy reported for `name` (a domain or task): known, and in [0, 1]."""
  if name not in known:
    raise ValueError(f"unknown {what} {name!r}; known: {', '.join(known)}")
  value = float(value)
  if not 0.0 <= value <= 1.0:
    raise ValueError(f"accuracy of {name!r} must be in [0, 1], got {value}")
  return value


class StagedSchedule:
  """Piecewise-constant domain weights: stage k holds from its start step to the next stage's.

  `stages` is [(start_step, {domain: weight}), ...], the first starting at step 0 and start
  steps strictly increasing; weights are normalised. The data-scaling study's order, for
  example: [(0, {"code": 1}), (200, {"code": 1, "math": 1}),
  (600, {"code": 1, "math": 1, "logic": 1, "general": 1})].
  """

  def __init__(self, stages: Sequence[tuple[int, Mapping[str, float]]]):
    self.stages = self._checked(stages)
    # The weights as given: normalising already-normalised floats again can move them an ulp.
    self._given = [[int(start), dict(weights)] for start, weights in stages]

  @staticmethod
  def _checked(stages) -> list[tuple[int, dict[str, float]]]:
    if not stages:
      raise ValueError("StagedSchedule needs at least one stage")
    checked = []
    for k, (start, weights) in enumerate(stages):
      start = int(start)
      if k == 0 and start != 0:
        raise ValueError(f"the first stage must start at step 0, got {start}")
      if k > 0 and start <= checked[-1][0]:
        raise ValueError(f"stage {k} starts at {start}, not after stage {k - 1} "
                         f"({checked[-1][0]})")
      checked.append((start, _normalized(weights, f"stage {k}")))
    return checked

  def stage_index(self, step: int) -> int:
    """Index of the stage that holds at `step`."""
    index = 0
    for k, (start, _) in enumerate(self.stages):
      if step >= start:
        index = k
    return index

  def weights(self, step: int) -> dict[str, float]:
    """Normalised domain weights at `step` (domains absent from the stage have weight 0)."""
    return dict(self.stages[self.stage_index(step)][1])

  def state_dict(self) -> dict[str, Any]:
    return {"stages": [[start, dict(weights)] for start, weights in self._given]}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores the checkpointed stages (a resumed run keeps the schedule it started with)."""
    given = [[int(start), dict(weights)] for start, weights in state["stages"]]
    if given != self._given:
      logging.warning("StagedSchedule: the checkpoint's stages %s replace the configured %s",
                      given, self._given)
    self.stages = self._checked(given)
    self._given = given


# ----------------------------------------------------------------------------- Online adaptation

class OnlineAdaptation:
  """Domain weights that follow recent accuracy: more weight where the policy is learning.

  Rule. For each domain, each `update` with that domain's accuracy a (in [0, 1]) moves a fast
  and a slow exponential moving average: fast <- (1 - fast_rate) fast + fast_rate a, slow alike
  with slow_rate (the first observation sets both to a). Then
    score = fast (1 - fast) + trend_coef * max(fast - slow, 0)   if lo <= fast <= hi,
    score = 0                                                     otherwise,
  so mid-range accuracy (the most learnable, p(1-p) being the variance of a 0/1 reward) and a
  rising accuracy (fast above slow) earn weight, while saturated (fast > hi) and hopeless
  (fast < lo) domains earn none. A domain not yet observed scores 0.25, the mid-range maximum,
  so that it is tried. Weights: floor + (1 - n floor) score / sum(score) over the n domains,
  uniform when every score is 0; so each domain keeps at least `floor` and none starves.
  """

  def __init__(self, domains: Sequence[str], *, fast_rate: float = 0.3, slow_rate: float = 0.05,
               trend_coef: float = 1.0, lo: float = 0.05, hi: float = 0.95,
               floor: float = 0.05):
    if not domains or len(set(domains)) != len(domains):
      raise ValueError(f"domains must be distinct and non-empty, got {list(domains)}")
    if not 0.0 < slow_rate <= fast_rate <= 1.0:
      raise ValueError(f"need 0 < slow_rate <= fast_rate <= 1, got {slow_rate}, {fast_rate}")
    if not 0.0 <= lo < hi <= 1.0:
      raise ValueError(f"need 0 <= lo < hi <= 1, got lo={lo}, hi={hi}")
    if not 0.0 <= floor * len(domains) <= 1.0:
      raise ValueError(f"floor {floor} times {len(domains)} domains must be in [0, 1]")
    self.domains = list(domains)
    self.fast_rate, self.slow_rate, self.trend_coef = fast_rate, slow_rate, trend_coef
    self.lo, self.hi, self.floor = lo, hi, floor
    self.fast: dict[str, float] = {}
    self.slow: dict[str, float] = {}

  def update(self, accuracy: Mapping[str, float]) -> None:
    """Folds in one step's mean accuracy per domain (domains not given are left as they are)."""
    for domain, value in accuracy.items():
      value = _accuracy(domain, value, self.domains, "domain")
      if domain not in self.fast:
        self.fast[domain] = self.slow[domain] = value
      else:
        self.fast[domain] += self.fast_rate * (value - self.fast[domain])
        self.slow[domain] += self.slow_rate * (value - self.slow[domain])

  def score(self, domain: str) -> float:
    """The unnormalised score of `domain` under the rule in the class docstring."""
    if domain not in self.fast:
      return 0.25
    fast, slow = self.fast[domain], self.slow[domain]
    if not self.lo <= fast <= self.hi:
      return 0.0
    return fast * (1.0 - fast) + self.trend_coef * max(fast - slow, 0.0)

  def weights(self) -> dict[str, float]:
    """Current normalised domain weights, each at least `floor`."""
    scores = {domain: self.score(domain) for domain in self.domains}
    total = sum(scores.values())
    if total <= 0:
      return {domain: 1.0 / len(self.domains) for domain in self.domains}
    spread = 1.0 - self.floor * len(self.domains)
    return {domain: self.floor + spread * s / total for domain, s in scores.items()}

  def state_dict(self) -> dict[str, Any]:
    return {"fast": dict(self.fast), "slow": dict(self.slow)}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    unknown = set(state["fast"]) - set(self.domains)
    if unknown:
      raise ValueError(f"checkpointed domains {sorted(unknown)} are not configured")
    self.fast = {domain: float(v) for domain, v in state["fast"].items()}
    self.slow = {domain: float(v) for domain, v in state["slow"].items()}


# ----------------------------------------------------------------------------- Difficulty

class DifficultyCurriculum:
  """One difficulty level per task, raised when the task's accuracy clears a threshold.

  `tasks` maps a task name to its number of levels (levels run over range(levels), as in
  `rl.rewards.puzzles.TASKS`). `update({task: accuracy})` records one step's accuracy; once at
  least `window` accuracies have been recorded at the current level and the last `window` of
  them average >= `threshold`, the level rises by one (up to levels - 1) and the window starts
  afresh, so each level is judged only on accuracy measured at that level.
  """

  def __init__(self, tasks: Mapping[str, int], *, threshold: float = 0.8, window: int = 10,
               start: Mapping[str, int] | None = None):
    if not tasks:
      raise ValueError("DifficultyCurriculum needs at least one task")
    if window <= 0:
      raise ValueError(f"window must be positive, got {window}")
    self.num_levels = {task: int(levels) for task, levels in tasks.items()}
    for task, levels in self.num_levels.items():
      if levels <= 0:
        raise ValueError(f"task {task!r} needs at least one level, got {levels}")
    self.threshold, self.window = threshold, window
    self.levels = {task: 0 for task in self.num_levels}
    for task, level in (start or {}).items():
      self._set_level(task, level)
    self.history = {task: collections.deque(maxlen=window) for task in self.num_levels}

  @classmethod
  def for_puzzles(cls, task_names: Sequence[str], **kwargs) -> DifficultyCurriculum:
    """A curriculum over puzzle tasks, their level counts taken from `puzzles.TASKS`."""
    return cls({name: puzzles.TASKS[name].levels for name in task_names}, **kwargs)

  def _set_level(self, task: str, level: int) -> None:
    if task not in self.num_levels:
      raise ValueError(f"unknown task {task!r}; known: {', '.join(self.num_levels)}")
    if not 0 <= level < self.num_levels[task]:
      raise ValueError(f"{task}: level {level} outside 0..{self.num_levels[task] - 1}")
    self.levels[task] = int(level)

  def level(self, task: str) -> int:
    return self.levels[task]

  def update(self, accuracy: Mapping[str, float]) -> list[str]:
    """Records one step's accuracy per task; returns the tasks whose level just rose."""
    raised = []
    for task, value in accuracy.items():
      value = _accuracy(task, value, self.num_levels, "task")
      history = self.history[task]
      history.append(value)
      at_top = self.levels[task] == self.num_levels[task] - 1
      if len(history) == self.window and np.mean(history) >= self.threshold and not at_top:
        self.levels[task] += 1
        history.clear()
        raised.append(task)
        logging.info("curriculum: %s difficulty -> %d", task, self.levels[task])
    return raised

  def state_dict(self) -> dict[str, Any]:
    return {"levels": dict(self.levels),
            "history": {task: list(values) for task, values in self.history.items()}}

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    for task, level in state["levels"].items():
      self._set_level(task, level)
    for task, values in state["history"].items():
      self.history[task] = collections.deque((float(v) for v in values), maxlen=self.window)


# ----------------------------------------------------------------------------- Mixture

def domain_counts(weights: Mapping[str, float], domains: Sequence[str], batch_size: int, *,
                  rng_seed) -> dict[str, int]:
  """Items per domain of a `batch_size` batch drawn by `weights` (normalised here): floor of
  each share, the remaining slots handed out by systematic sampling over the fractional parts,
  so a domain gets floor or ceil of batch_size * w and exactly batch_size * w in expectation."""
  missing = [d for d, w in weights.items() if w > 0 and d not in domains]
  if missing:
    raise ValueError(f"weights name domains without records: {missing}; "
                     f"have {', '.join(domains)}")
  probabilities = _normalized({d: weights.get(d, 0.0) for d in domains}, "domain weights")
  exact = np.array([probabilities[d] * batch_size for d in domains])
  # The tolerance lets a share that is a whole count up to rounding (0.7 * 10) be exactly it.
  counts = np.floor(exact + 1e-9).astype(np.int64)
  remainder = batch_size - int(counts.sum())
  if remainder > 0:
    # Systematic sampling: slots u, u+1, ... over the stacked fractional parts (each < 1)
    # give each domain at most one extra record, with probability exactly its fraction.
    fractional = np.maximum(exact - counts, 0.0)
    edges = np.cumsum(fractional)
    slots = np.random.default_rng(rng_seed).random() + np.arange(remainder)
    winners = np.minimum(np.searchsorted(edges, slots, side="right"), len(domains) - 1)
    np.add.at(counts, winners, 1)
  return {domain: int(c) for domain, c in zip(domains, counts)}


def parse_stages(text: str) -> list[tuple[int, dict[str, float]]]:
  """"0:code=1;200:code=1,math=1" -> [(0, {"code": 1.0}), (200, {"code": 1.0, "math": 1.0})]."""
  stages = []
  for part in filter(None, (p.strip() for p in text.split(";"))):
    start, _, spec = part.partition(":")
    try:
      weights = domain_values(spec, "weight")
    except ValueError as e:
      raise ValueError(f"curriculum stage {part!r}: {e}") from None
    try:
      stages.append((int(start), weights))
    except ValueError:
      raise ValueError(f"curriculum stage {part!r}: {start!r} is not a start step") from None
  return stages
