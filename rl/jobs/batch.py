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
from rl.rewards.shaping import overlong_penalty


# ======================================================================== Reward

class ResponseGrader:
  """Grades single-turn responses: decoded, then scored by the reward manager
  (rl/rewards/manager.py: model output is never evaluated in this process). Tool-use episodes
  have their own grader (rl/tool_use/episodes.ToolEpisodes: score, metrics)."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def score(self, traj, entries: Sequence[Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """Per row: acc and reward (the same 0/1 verdict)."""
    tokens = np.asarray(traj.tokens)
    resp_mask = np.asarray(traj.response_mask).astype(bool)
    responses = [self.tokenizer.decode(tokens[n][resp_mask[n]]) for n in range(len(tokens))]
    acc = manager.score_responses(entries, responses)
    return {"acc": acc, "reward": acc}

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
  +-1, the overlong penalty, each row's KL weight. The grader's other per-row fields (a tool
  episode's turns, tool calls and errors) stay in the result."""
  lengths = np.asarray(traj.response_mask).astype(bool).sum(-1)
  graded = dict(grader.score(traj, entries))
  acc, reward = graded.pop("acc"), graded.pop("reward")
  rl = cfg.rl
  scores = 2.0 * reward - 1.0 if rl.reward_mode == "dapo" else reward.copy()
  if rl.overlong_buffer:
    scores = scores + np.asarray(overlong_penalty(
        jnp.asarray(lengths), max_len=cfg.rollout.max_new_tokens, buffer=rl.overlong_buffer,
        factor=rl.overlong_factor))
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
