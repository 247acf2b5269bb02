"""Rollout sources: where the RL trainer's trajectories come from, behind one interface.

The trainer (rl/jobs/trainer.py) picks its source once from the config and then, every
generation batch of every step, makes the same call:

  rollout = source.generate(graphdef, state, prompts, entries, rng, policy_version=step)

and gets back the `Trajectories`, the entry each row answers (rows are grouped by prompt,
`traj.group_id`) and the source's statistics for the step's metrics. Sources:

  EngineSource      single-turn generation with the rollout engine (rl/rollout/trajectories.py),
                    `num_samples` responses per prompt, all under the current policy;
  StreamingSource   the streaming pool of partial generations (rl/rollout/streaming.py): the
                    prompts join the pool and `num_groups` complete groups come out, some started
                    by earlier policy versions; its statistics are the pool's ("stream/...");
  EpisodeSource     multi-turn tool-use episodes (rl/tool_use/episodes.py, it lives there: it
                    runs tools), graded later by their environment's verifier.

Each source's rows are then scored by a `Grader` (below), the other interface the trainer holds.

O1-Coder self-play (rl/o1_coder/selfplay.py) is a job with its own loop: its MCTS search builds
step-value trees for the process reward model, not trajectories for this trainer's update.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from rl.core.types import Trajectories
from rl.rollout import engine, trajectories
from rl.rollout.streaming import StreamingRollout


class Rollout(NamedTuple):
  traj: Trajectories
  entries: list[Any]  # per row: the entry (payload) its prompt was submitted with
  stats: Mapping[str, float]  # the source's own metrics, keys already prefixed


class RolloutSource(Protocol):
  """What the trainer calls; see the module docstring."""

  def prompts_wanted(self, num_groups: int) -> int:
    """How many prompts to hand the next `generate` for a batch of `num_groups` groups."""

  def generate(self, graphdef, state, prompts: Sequence[Sequence[int]],
               entries: Sequence[Any], rng, *, policy_version: int) -> Rollout:
    """Trajectories of `prompts` (entries[i] is prompt i's record) sampled by `state`, the
    policy of version `policy_version`."""

  def close(self) -> None:
    """Releases what the source holds (threads, pools) at the end of the run."""


class Grader(Protocol):
  """What the trainer grades a generation batch with (rl/jobs/batch.py score_trajectories):
  rl/jobs/batch.ResponseGrader (single-turn responses, by the record graders of
  rl/rewards/manager.py, the registry evaluation grades with too) or
  rl/tool_use/episodes.ToolEpisodes (the environments' verifiers and judge)."""

  def score(self, traj: Trajectories, entries: Sequence[Any]) -> dict[str, np.ndarray]:
    """Per row: acc (the verdict, in [0, 1]), reward (what the update optimises before
    shaping, in [0, 1]) and the grader's own per-row fields."""

  def metrics(self, scored: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The grader's metrics of one scored batch."""


class EngineSource:
  """`num_samples` single-turn responses per prompt from the rollout engine."""

  def __init__(self, cfg: engine.RolloutConfig, *, num_samples: int, mesh=None):
    self.cfg = cfg
    self.num_samples = num_samples
    self.mesh = mesh  # the rollout mesh (split placement) or None (the trainer's arrays)

  def prompts_wanted(self, num_groups: int) -> int:
    return num_groups

  def generate(self, graphdef, state, prompts, entries, rng, *, policy_version: int) -> Rollout:
    traj = trajectories.generate(graphdef, state, prompts, rng, self.cfg,
                                 num_samples=self.num_samples, policy_version=policy_version,
                                 mesh=self.mesh)
    return Rollout(traj, [entries[g] for g in np.asarray(traj.group_id)], {})

  def close(self) -> None:
    pass


class StreamingSource:
  """The prompts join the streaming pool; `num_groups` complete groups come out. An empty pool
  is handed twice the prompts a batch needs, so unfinished groups carry over to the next step.
  `rng` is unused: the pool seeds its own per-sequence streams, so a partial generation resumes
  its own draws whichever step continues it."""

  def __init__(self, stream: StreamingRollout, *, num_groups: int):
    self.stream = stream
    self.num_groups = num_groups

  def prompts_wanted(self, num_groups: int) -> int:
    empty = not self.stream.num_in_flight + self.stream.num_ready
    return 2 * num_groups if empty else num_groups

  def generate(self, graphdef, state, prompts, entries, rng, *, policy_version: int) -> Rollout:
    self.stream.submit(prompts, payloads=entries)
    traj, payloads, stats = self.stream.collect(graphdef, state, policy_version=policy_version,
                                                num_groups=self.num_groups)
    return Rollout(traj, [payloads[g] for g in np.asarray(traj.group_id)],
                   {f"stream/{k}": float(v) for k, v in stats.items()})

  def close(self) -> None:
    pass
