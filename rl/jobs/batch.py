"""From a generation batch to the update's batch, for the RL trainer (rl/jobs/trainer.py):
grading and reward shaping, per-row KL weights, concatenation of the batches a step kept, and
the fields of the update's mini-batches (rl/core/train_step.py). Host-side numpy, no state."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from rl.core import algorithms
from rl.data.curriculum import domain_of
from rl.rewards import manager
from rl.data.templates import prompt_of
from rl.rewards.shaping import language_consistency, length_penalty, overlong_penalty


# ======================================================================== Reward

class ResponseGrader:
  """The `Grader` (rl/rollout/sources.py) of single-turn responses: decoded, then scored by
  the run's registry of record graders (rl/rewards/manager.py, built from config.reward by
  rl/jobs/reward_models.py; model output is never evaluated in this process). Tool-use episodes
  are the other Grader (rl/tool_use/episodes.ToolEpisodes)."""

  def __init__(self, tokenizer, graders: Mapping[str, manager.RecordGrader] = manager.RULES):
    self.tokenizer = tokenizer
    self.graders = graders

  def score(self, traj, entries: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Per row: acc and reward (the same score: a verifier's 0/1, an RM's probability) and the
    response text (for the shaping terms)."""
    tokens = np.asarray(traj.tokens)
    resp_mask = np.asarray(traj.response_mask).astype(bool)
    responses = [self.tokenizer.decode(tokens[n][resp_mask[n]]) for n in range(len(tokens))]
    acc = manager.score_responses(entries, responses, graders=self.graders)
    return {"acc": acc, "reward": acc, "response": np.array(responses, dtype=object)}

  def metrics(self, scored: Mapping[str, np.ndarray]) -> dict[str, float]:
    return {}


def accuracy_by_domain(entries: Sequence[Mapping[str, Any]], acc: np.ndarray
                       ) -> dict[str, float]:
  """`acc/<domain>`: the rows' mean accuracy per domain of their entries: a generated puzzle's
  task, a tool episode's environment, else a prompt record's domain (math, code, ...)."""
  domains = np.array([e.get("env") or domain_of(e) for e in entries])
  return {f"acc/{d}": float(np.mean(acc[domains == d])) for d in sorted(set(domains.tolist()))}


def score_trajectories(traj, entries, grader, cfg: ml_collections.ConfigDict
                       ) -> dict[str, np.ndarray]:
  """Grades the rows (`grader`: ResponseGrader or ToolEpisodes) and shapes the reward: DAPO's
  +-1, the overlong penalty, DeepSeek-V3.2's length penalty and language-consistency reward
  (config.reward), each row's KL weight. The grader's other per-row fields (a tool
  episode's turns, tool calls and errors) stay in the result."""
  lengths = np.asarray(traj.response_mask).astype(bool).sum(-1)
  graded = dict(grader.score(traj, entries))
  acc, reward = graded.pop("acc"), graded.pop("reward")
  responses = graded.pop("response", None)
  rl = cfg.rl
  scores = 2.0 * reward - 1.0 if rl.reward_mode == "dapo" else reward.copy()
  if rl.overlong_buffer:
    scores = scores + np.asarray(overlong_penalty(
        jnp.asarray(lengths), max_len=cfg.rollout.max_new_tokens, buffer=rl.overlong_buffer,
        factor=rl.overlong_factor))
  if cfg.reward.length_penalty:
    scores = scores + np.asarray(length_penalty(
        jnp.asarray(lengths), max_len=cfg.rollout.max_new_tokens,
        coef=cfg.reward.length_penalty))
  if cfg.reward.language_reward:
    if responses is None:
      raise ValueError("config.reward.language_reward scores single-turn responses; the tool "
                       "episodes' grader gives none")
    scores = scores + cfg.reward.language_reward * np.array(
        [language_consistency(prompt_of(e), r) for e, r in zip(entries, responses)], np.float32)
  return {"acc": acc, "scores": scores.astype(np.float32), "lengths": lengths,
          "kl_coef": kl_coefs(entries, rl), **graded}


def kl_coefs(entries, rl) -> np.ndarray:
  """Each row's KL weight: its domain's beta in config.rl.kl_coef_per_domain (a generated
  puzzle's task, else the record's domain: rl.data.curriculum.domain_of), else
  config.rl.kl_coef."""
  betas = algorithms.kl_coefs_by_domain(rl.kl_coef_per_domain)
  return np.array([betas.get(domain_of(e), rl.kl_coef) for e in entries], np.float32)


# ======================================================================== Batch

def concat_trajectories(parts):
  """One Trajectories of several generation batches, right-padded to the widest."""
  width = max(p.tokens.shape[1] for p in parts)

  def pad(x):
    if x is None or x.ndim < 2 or x.shape[1] == width:
      return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, width - x.shape[1])
    return np.pad(np.asarray(x), widths)

  def cat(*xs):
    if xs[0] is None:
      return None
    return np.concatenate([np.asarray(pad(x)) for x in xs])
  return jax.tree.map(cat, *parts, is_leaf=lambda x: x is None)


def take_rows(traj, rewards: Mapping[str, np.ndarray], rows: np.ndarray):
  """(trajectories, rewards) of the rows `rows` (a boolean mask) selects."""
  return (jax.tree.map(lambda x: np.asarray(x)[rows], traj),
          {k: v[rows] for k, v in rewards.items()})


def build_batch(traj, rewards, advs, rl: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
  """The update's fields of a step's trajectories (all but the reference log-probs)."""
  tokens = np.asarray(traj.tokens)
  width = tokens.shape[1]
  # Attend up to each row's last policy token: tool results inside the response (mask 0)
  # make prompt_len + sum(mask) too short, and tokens after it carry no loss.
  resp = np.asarray(traj.response_mask).astype(bool)
  last_policy = np.where(resp.any(-1), width - np.argmax(resp[:, ::-1], -1), 0)
  total_len = np.maximum(np.asarray(traj.prompt_lens), last_policy)
  batch = {
      "tokens": tokens,
      "response_mask": np.asarray(traj.response_mask, np.float32),
      "attention_mask": (np.arange(width)[None, :] < total_len[:, None]).astype(np.float32),
      "logp_old": np.asarray(traj.logp_old, np.float32),
      "acc": rewards["acc"],
      **advs,
  }
  if rl.overlong_filter:
    batch["response_mask"] = batch["response_mask"] * (~np.asarray(traj.truncated))[:, None]
  if rl.keep_routing and traj.routing is not None:
    batch["routing"] = np.asarray(traj.routing)
  if rl.keep_sampling_mask and traj.kept_ids is not None:
    batch["kept_ids"] = np.asarray(traj.kept_ids)
  return batch
