"""Tool-use episodes for the RL trainer when `config.tools.enabled`: environment entries as
prompt records, multi-turn episodes as its rollout source (`EpisodeSource`, the interface of
rl/rollout/sources.py) in place of single-turn generation, verifier (+ judge) rewards and their
per-environment metrics, and the warm start on expert transcripts."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from models.padding import round_up
from rl.core import train_step as ts
from rl.data.entries import train_seed
from rl.rewards import sandbox
from rl.rollout import engine as rollout_lib
from rl.rollout.sources import Rollout
from rl.tool_use import calls, demonstrations, environments, reward
from rl.tool_use.rollout import ToolRollout, ToolRolloutConfig


def environment_names(c: ml_collections.ConfigDict) -> list[str]:
  return [name.strip() for name in c.tools.environments.split(",") if name.strip()]


class ToolEpisodes:
  """The tool-use episodes of one run: their tasks, prompts, thread pool, multi-turn rollout,
  grading (verifier + judge; it is the run's `Grader`, rl/rollout/sources.py) and warm
  start."""

  def __init__(self, c: ml_collections.ConfigDict, tokenizer):
    t = c.tools
    self.config = c
    self.tokenizer = tokenizer
    self.names = environment_names(c)
    envs = [environments.get(name) for name in self.names]
    if (any("python" in env.tools for env in envs) and sandbox.bwrap_path() is None
        and not t.allow_weak_sandbox):
      raise sandbox.SandboxUnavailableError(
          f"tool environments {self.names} run model-written code, and bubblewrap is not "
          "installed: run `bash launch/setup_sandbox.sh` as root, or set "
          "config.tools.allow_weak_sandbox=True to accept rlimit-only isolation")
    self.runner = calls.ToolRunner(workers=t.workers, timeout_s=t.timeout_s,
                                   allow_weak_sandbox=t.allow_weak_sandbox)
    self.rollout = ToolRollout(tokenizer, ToolRolloutConfig(
        max_new_tokens=c.rollout.max_new_tokens, max_turns=t.max_turns,
        max_tool_tokens=t.max_tool_tokens, waves=t.waves,
        prompt_bucket=c.rollout.prompt_bucket, pad_id=tokenizer.pad_id), self.runner)
    self.judge = reward.load_judge(t.judge_hf_dir) if t.judge_weight else None
    self.prompt_width = 0  # the longest encoded prompt, bucketed: one engine shape per run

  def entries(self) -> tuple[list[dict], list[dict]]:
    """(train, held-out) entries; held-out tasks come from another seed, minus any question
    also in the training set."""
    c = self.config
    train = environments.make_entries(self.names, c.data.train_size, train_seed(c))
    seen = {e["prompt"] for e in train}
    heldout = [e for e in environments.make_entries(self.names, c.data.heldout_size,
                                                    c.data.heldout_seed)
               if e["prompt"] not in seen]
    if not heldout:
      raise ValueError("every held-out tool task is also a training task: change "
                       "config.data.heldout_seed or the sizes")
    return train, heldout

  def encode(self, entries: Sequence[Mapping[str, Any]]) -> list[list[int]]:
    prompts = [environments.encode_prompt(e, self.tokenizer) for e in entries]
    longest = max(len(p) for p in prompts)
    self.prompt_width = max(self.prompt_width, round_up(
        longest, self.config.rollout.prompt_bucket))
    return prompts

  def generate(self, graphdef, state, prompts: Sequence[Sequence[int]],
               entries: Sequence[Mapping[str, Any]], rng, engine_cfg: rollout_lib.RolloutConfig,
               *, num_samples: int, policy_version: int = 0):
    """`num_samples` episodes per prompt (rows grouped by prompt, as
    rl.rollout.trajectories.generate); returns Trajectories and per-row entries carrying their
    episode info under "episode"."""
    rows_prompts = [p for p in prompts for _ in range(num_samples)]
    rows_entries = [e for e in entries for _ in range(num_samples)]
    group_id = np.repeat(np.arange(len(prompts)), num_samples)
    generate = self.rollout.engine_generate(graphdef, state, rng, engine_cfg,
                                            self.rollout.wave_rows(len(rows_prompts)))
    traj, infos = self.rollout.run(rows_prompts, rows_entries, generate, group_id=group_id,
                                   policy_version=policy_version, prompt_width=self.prompt_width)
    return traj, [{**e, "episode": info} for e, info in zip(rows_entries, infos)]

  def warm_start(self, graphdef, params, rest, entries: Sequence[Mapping[str, Any]],
                 prompts: Sequence[Sequence[int]]):
    """Policy params after `config.tools.warm_start_steps` SFT steps on demonstration
    transcripts of the first training tasks (config.sft: batch_size rows a step, lr, weight
    decay and grad clip)."""
    c = self.config
    rows = c.sft.batch_size
    count = min(len(entries), c.tools.warm_start_steps * rows) // rows * rows
    if not count:
      raise ValueError(f"config.tools.warm_start_steps needs at least config.sft.batch_size="
                       f"{rows} training tasks, there are {len(entries)}")
    batches = []
    for start in range(0, count, rows):
      traj, _ = demonstrations.transcripts(
          self.rollout, prompts[start:start + rows], entries[start:start + rows],
          prompt_width=self.prompt_width)
      batches.append(traj)
    optimizer = ts.make_optimizer(lr=c.sft.lr, warmup_steps=None, weight_decay=c.sft.weight_decay,
                                  grad_clip=c.sft.grad_clip)
    params, losses = demonstrations.warm_start(graphdef, params, rest, batches,
                                               steps=c.tools.warm_start_steps,
                                               optimizer=optimizer, seed=c.seed)
    logging.info("tool warm start: %d steps on %d transcripts, loss %.3f -> %.3f",
                 len(losses), count, losses[0], losses[-1])
    return params

  def source(self, cfg: rollout_lib.RolloutConfig, *, num_samples: int) -> EpisodeSource:
    return EpisodeSource(self, cfg, num_samples=num_samples)

  def score(self, traj, entries: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Per row: acc (verifier), reward (mixed with the judge) and the episode's statistics."""
    return reward.score_episodes(traj, entries, self.tokenizer, judge=self.judge,
                                 judge_weight=self.config.tools.judge_weight)

  def metrics(self, scored: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per-environment success, turns, tool calls and errors of scored rows."""
    return reward.episode_metrics(scored)


class EpisodeSource:
  """`num_samples` tool-use episodes per prompt, sampled with `cfg`: a rollout source
  (rl/rollout/sources.py). Its rows' entries carry their episode info under "episode". The
  sources of one ToolEpisodes share its thread pool; closing one closes it."""

  def __init__(self, episodes: ToolEpisodes, cfg: rollout_lib.RolloutConfig, *,
               num_samples: int):
    self.episodes = episodes
    self.cfg = cfg
    self.num_samples = num_samples

  def prompts_wanted(self, num_groups: int) -> int:
    return num_groups

  def generate(self, graphdef, state, prompts, entries, rng, *, policy_version: int
               ) -> Rollout:
    traj, row_entries = self.episodes.generate(
        graphdef, state, prompts, entries, rng, self.cfg, num_samples=self.num_samples,
        policy_version=policy_version)
    return Rollout(traj, row_entries, {})

  def close(self) -> None:
    self.episodes.runner.close()
