"""Advantage estimators (docs/rl_algorithms.md section 3). Pure jax functions, jit-safe: no
Python loops over tokens (GAE walks the sequence with `lax.scan`).

Group ids may be any integers (the trainer offsets them per generation batch); they are
re-indexed densely inside with a static-size `jnp.unique`.

`ESTIMATOR_REGISTRY` holds the estimators a config names (`config.rl.estimator`), all called
the same way by `estimate`: `fn(scores [B], group_ids [B], token_rewards [B, T], mask [B, T],
values [B, T] or None, rl) -> {"advantages": [B, T], ...}`, where `rl` is the config's `rl`
section. An entry declares the keys it returns (`outputs`: they become fields of the update's
batch, rl/core/train_step.py) and whether it reads the critic's values (`needs_values`): such an
entry (GAE) is what makes a run train a critic, and it also returns the critic's targets
("returns") and the values it used ("values"), which the critic's update reads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rl.core.registry import Registry


def _group_stats(scores: jax.Array, group_ids: jax.Array):
  """Per-row group size, group mean and unbiased group std (std = 1 for a group of one)."""
  n = scores.shape[0]
  _, inverse = jnp.unique(group_ids, return_inverse=True, size=n)
  inverse = inverse.reshape(n)
  count = jax.ops.segment_sum(jnp.ones_like(scores), inverse, num_segments=n)
  total = jax.ops.segment_sum(scores, inverse, num_segments=n)
  mean = total / jnp.maximum(count, 1.0)
  sq = jax.ops.segment_sum((scores - mean[inverse]) ** 2, inverse, num_segments=n)
  var = sq / jnp.maximum(count - 1.0, 1.0)
  size = count[inverse]
  single = size < 2
  mean_i = jnp.where(single, 0.0, mean[inverse])
  std_i = jnp.where(single, 1.0, jnp.sqrt(var[inverse]))
  return size, mean_i, std_i


def grpo(scores: jax.Array, group_ids: jax.Array, *, normalize_std: bool = True,
         eps: float = 1e-6) -> jax.Array:
  """GRPO: (s_i - mean_g) / (std_g + eps), unbiased std; Dr.GRPO (`normalize_std=False`):
  s_i - mean_g. A group of one uses mean 0 and std 1."""
  scores = jnp.asarray(scores, jnp.float32)
  _, mean, std = _group_stats(scores, jnp.asarray(group_ids))
  adv = scores - mean
  return adv / (std + eps) if normalize_std else adv


def rloo(scores: jax.Array, group_ids: jax.Array) -> jax.Array:
  """RLOO: G/(G-1) * (s_i - mean_g), i.e. s_i minus the mean of the other G-1 samples.
  A group of one has no baseline: its advantage is s_i."""
  scores = jnp.asarray(scores, jnp.float32)
  size, mean, _ = _group_stats(scores, jnp.asarray(group_ids))
  return jnp.where(size < 2, scores, size / jnp.maximum(size - 1.0, 1.0) * (scores - mean))


def gae(rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float = 1.0,
        lam=1.0) -> tuple[jax.Array, jax.Array]:
  """Generalised advantage estimation over masked-in tokens.

  delta_t = r_t + gamma V_next - V_t;  A_t = delta_t + gamma lam A_next, walking backwards;
  masked-out tokens pass V_next and A_next through unchanged (so tool outputs or padding
  between response tokens do not break the recursion). The state after the last token is
  terminal (V = 0). `lam` is a scalar or a per-sequence [B] array (length-adaptive GAE).
  Returns (advantages, returns = advantages + values), both zero off the mask.
  """
  rewards = jnp.asarray(rewards, jnp.float32)
  values = jnp.asarray(values, jnp.float32)
  m = jnp.asarray(mask, jnp.float32)
  lam = jnp.broadcast_to(jnp.asarray(lam, jnp.float32), rewards.shape[:1])

  def step(carry, xs):
    next_value, next_adv = carry
    r, v, mt = xs
    delta = r + gamma * next_value - v
    adv = delta + gamma * lam * next_adv
    next_value = mt * v + (1.0 - mt) * next_value
    next_adv = mt * adv + (1.0 - mt) * next_adv
    return (next_value, next_adv), adv

  zeros = jnp.zeros(rewards.shape[:1], jnp.float32)
  _, adv = jax.lax.scan(step, (zeros, zeros), (rewards.T, values.T, m.T), reverse=True)
  adv = adv.T * m
  return adv, (adv + values) * m


def length_adaptive_lambda(lengths: jax.Array, *, alpha: float = 0.05) -> jax.Array:
  """VAPO: lam_policy = 1 - 1 / (alpha * l), clamped to [0, 1] (negative for l < 1/alpha)."""
  lengths = jnp.asarray(lengths, jnp.float32)
  return jnp.clip(1.0 - 1.0 / (alpha * jnp.maximum(lengths, 1e-9)), 0.0, 1.0)


def masked_whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
  """(x - mean) / sqrt(var + eps) over masked-in entries; unbiased variance; 0 off the mask."""
  m = jnp.asarray(mask, jnp.float32)
  n = jnp.sum(m)
  mean = jnp.sum(x * m) / jnp.maximum(n, 1.0)
  var = jnp.sum(((x - mean) * m) ** 2) / jnp.maximum(n - 1.0, 1.0)
  return (x - mean) * jax.lax.rsqrt(var + eps) * m


def reinforce_pp(rewards: jax.Array, mask: jax.Array, *, gamma: float = 1.0) -> jax.Array:
  """REINFORCE++: discounted return over response tokens, whitened over the whole batch."""
  returns, _ = gae(rewards, jnp.zeros_like(rewards, jnp.float32), mask, gamma=gamma, lam=1.0)
  return masked_whiten(returns, mask)


# ----------------------------------------------------------------------------- Registry


class Estimator(NamedTuple):
  fn: Callable[..., dict[str, jax.Array]]
  needs_values: bool  # reads the critic's values: the run trains a critic (rl/core/algorithms)
  outputs: tuple[str, ...]  # the keys fn returns, "advantages" first


ESTIMATOR_REGISTRY = Registry("config.rl.estimator")
CRITIC_TARGETS = ("returns", "values")  # what the critic's update reads of a needs_values entry


def register_estimator(name: str, *, needs_values: bool = False,
                       outputs: tuple[str, ...] = ("advantages",)) -> Callable:
  """Decorator: registers an estimator under the calling convention of `estimate`, returning
  the keys `outputs`; ValueError when they lack "advantages" or, with `needs_values`, the
  critic's targets."""
  need = ("advantages",) + (CRITIC_TARGETS if needs_values else ())
  missing = [k for k in need if k not in outputs]
  if missing:
    raise ValueError(f"estimator {name!r} (needs_values={needs_values}): outputs "
                     f"{list(outputs)} lack {missing}")

  def decorate(fn):
    ESTIMATOR_REGISTRY.add(name, Estimator(fn, needs_values, tuple(outputs)))
    return fn
  return decorate


def estimate(rl: Mapping[str, Any], scores: jax.Array, group_ids: jax.Array,
             token_rewards: jax.Array, mask: jax.Array,
             values: Callable[[], jax.Array]) -> dict[str, jax.Array]:
  """The advantages of `rl["estimator"]`: scores [B] are each response's total reward,
  token_rewards [B, T] the same rewards placed on response tokens, `values()` the critic's
  values [B, T] (called only by an estimator that needs them). ValueError when the estimator
  returns other keys than it declared."""
  estimator = ESTIMATOR_REGISTRY[rl["estimator"]]
  out = estimator.fn(scores, group_ids, token_rewards, mask,
                     values() if estimator.needs_values else None, rl)
  if set(out) != set(estimator.outputs):
    raise ValueError(f"config.rl.estimator={rl['estimator']!r} returned {sorted(out)}, not its "
                     f"declared outputs {list(estimator.outputs)}")
  return out


@register_estimator("grpo")
def _grpo(scores, group_ids, token_rewards, mask, values, rl):
  return {"advantages": grpo(scores, group_ids)[:, None] * mask}


@register_estimator("dr_grpo")
def _dr_grpo(scores, group_ids, token_rewards, mask, values, rl):
  return {"advantages": grpo(scores, group_ids, normalize_std=False)[:, None] * mask}


@register_estimator("rloo")
def _rloo(scores, group_ids, token_rewards, mask, values, rl):
  return {"advantages": rloo(scores, group_ids)[:, None] * mask}


@register_estimator("reinforce_pp")
def _reinforce_pp(scores, group_ids, token_rewards, mask, values, rl):
  return {"advantages": reinforce_pp(token_rewards, mask, gamma=rl["gamma"])}


@register_estimator("gae", needs_values=True, outputs=("advantages",) + CRITIC_TARGETS)
def _gae(scores, group_ids, token_rewards, mask, values, rl):
  """Decoupled GAE: the policy's advantages with lam (length-adaptive when
  length_adaptive_alpha > 0), the critic's returns with lam_critic."""
  lam = rl["lam"]
  if rl["length_adaptive_alpha"]:
    lam = length_adaptive_lambda(jnp.sum(mask, -1), alpha=rl["length_adaptive_alpha"])
  advantages, _ = gae(token_rewards, values, mask, gamma=rl["gamma"], lam=lam)
  _, returns = gae(token_rewards, values, mask, gamma=rl["gamma"], lam=rl["lam_critic"])
  return {"advantages": advantages, "returns": returns, "values": values}
