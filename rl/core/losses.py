"""Losses of the RL and preference objectives (docs/rl_algorithms.md sections 1, 2, 4, 5, 7, 9).

Per-token inputs are [B, T] aligned with each other; masks are float or bool. `aggregate` is
the single place where per-token terms become a scalar: pass the *global* `num_tokens` /
`num_seqs` of the mini-batch when one call sees only a micro-batch or a data shard, so the
summed pieces equal the unsplit loss exactly.

Two registries hold what a config names (rl/core/registry.py):
  POLICY_LOSS_REGISTRY  `config.rl.policy_loss`: fn(logp, logp_old, advantages, mask, rl,
                        **agg_kwargs) -> (loss, metrics), `rl` the config's `rl` section; the
                        metrics join the update's (rl/core/train_step.py), which adds them up
                        over micro-batches (`*_max` / `*_min`: max / min), so a token mean
                        divides by agg_kwargs' global `num_tokens`;
  KL_REGISTRY           `config.rl.kl_kind`: fn(logp, logp_old, logp_ref) -> per-token KL [B, T]
                        (the sample estimators k1 / k2 / k3 do not read logp_old).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl.core.registry import Registry
from rl.core.sampling import next_token_logprobs

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm")
POLICY_LOSS_REGISTRY = Registry("config.rl.policy_loss")
register_policy_loss = POLICY_LOSS_REGISTRY.register
KL_REGISTRY = Registry("config.rl.kl_kind")
register_kl = KL_REGISTRY.register


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str, *, num_tokens=None,
              num_seqs=None, max_len=None) -> jax.Array:
  """Masked reduction of a [B, T] per-token term to a scalar.

    token-mean               sum m*L / N_tok
    seq-mean-token-mean      (1/B) sum_i sum_t m*L / sum_t m
    seq-mean-token-sum       (1/B) sum_i sum_t m*L
    seq-mean-token-sum-norm  (1/B) sum_i sum_t m*L / max_len      (Dr.GRPO)

  N_tok defaults to sum(m) of this call, B to its row count, max_len to T.
  """
  m = jnp.asarray(mask, jnp.float32)
  x = per_token * m
  if mode == "token-mean":
    n = jnp.sum(m) if num_tokens is None else num_tokens
    return jnp.sum(x) / jnp.maximum(n, 1.0)
  b = m.shape[0] if num_seqs is None else num_seqs
  seq_sum = jnp.sum(x, axis=-1)
  if mode == "seq-mean-token-mean":
    return jnp.sum(seq_sum / jnp.maximum(jnp.sum(m, axis=-1), 1.0)) / b
  if mode == "seq-mean-token-sum":
    return jnp.sum(seq_sum) / b
  if mode == "seq-mean-token-sum-norm":
    s = m.shape[-1] if max_len is None else max_len
    return jnp.sum(seq_sum) / (b * s)
  raise ValueError(f"loss_agg_mode={mode!r}: must be one of {list(AGG_MODES)}")


def policy_loss(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array, mask: jax.Array,
                *, eps_low: float = 0.2, eps_high: float = 0.2, clip_c=None,
                agg: str = "token-mean", **agg_kwargs) -> tuple[jax.Array, dict]:
  """PPO clipped surrogate with Clip-Higher (eps_low != eps_high) and optional dual clip
  (clip_c > 1 bounds the loss of negative-advantage tokens at -A * c).

  Metrics (token means over the mask, divided by `num_tokens` when given, else by this call's
  token count): clipfrac_low / clipfrac_high (tokens whose gradient the clip removes),
  clipfrac_dual, approx_kl (mean logp_old - logp), ratio_max / ratio_min.
  """
  m = jnp.asarray(mask, jnp.float32)
  ratio = jnp.exp(jnp.clip(logp - logp_old, -20.0, 20.0))
  loss1 = -advantages * ratio
  loss2 = -advantages * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  per_token = jnp.maximum(loss1, loss2)
  dual = jnp.zeros_like(per_token, bool)
  if clip_c is not None:
    if clip_c <= 1:
      raise ValueError(f"dual-clip constant clip_c={clip_c}: must be > 1")
    bound = -advantages * clip_c
    dual = (advantages < 0) & (per_token > bound)
    per_token = jnp.where(advantages < 0, jnp.minimum(per_token, bound), per_token)
  loss = aggregate(per_token, m, agg, **agg_kwargs)

  num_tokens = agg_kwargs.get("num_tokens")
  n = jnp.maximum(jnp.sum(m) if num_tokens is None else num_tokens, 1.0)

  def frac(b):
    return jnp.sum(b.astype(jnp.float32) * m) / n
  on = m > 0
  metrics = {
      "pg_loss": loss,
      "clipfrac_high": frac((advantages > 0) & (ratio > 1.0 + eps_high)),
      "clipfrac_low": frac((advantages < 0) & (ratio < 1.0 - eps_low)),
      "clipfrac_dual": frac(dual),
      "approx_kl": jnp.sum((logp_old - logp) * m) / n,
      "ratio_max": jnp.max(jnp.where(on, ratio, -jnp.inf)),
      "ratio_min": jnp.min(jnp.where(on, ratio, jnp.inf)),
  }
  return loss, metrics


@register_policy_loss("ppo_clip")
def _ppo_clip(logp, logp_old, advantages, mask, rl, **agg_kwargs):
  """`policy_loss` with the config's clip range, dual-clip constant (0: off) and aggregation."""
  return policy_loss(logp, logp_old, advantages, mask, eps_low=rl["clip_low"],
                     eps_high=rl["clip_high"], clip_c=rl["clip_c"] or None,
                     agg=rl["loss_agg_mode"], **agg_kwargs)


def kl(logp: jax.Array, logp_ref: jax.Array, kind: str) -> jax.Array:
  """Per-token KL(pi_theta || pi_ref) estimators on samples from pi_theta, delta = logp -
  logp_ref: k1 = delta, k2 = delta^2 / 2, k3 = exp(-delta) + delta - 1 (low-variance; -delta
  clamped to [-20, 20] and the result to [-10, 10]). The registry's other entry, "unbiased",
  is on samples from pi_old and needs their log-probs: `unbiased_kl`."""
  if kind == "unbiased":
    raise ValueError("kl kind='unbiased' needs logp_old: call unbiased_kl")
  return KL_REGISTRY[kind](logp, None, logp_ref)


@register_kl("k1")
def _k1(logp, logp_old, logp_ref):
  return logp - logp_ref


@register_kl("k2")
def _k2(logp, logp_old, logp_ref):
  return 0.5 * (logp - logp_ref) ** 2


@register_kl("k3")
def _k3(logp, logp_old, logp_ref):
  neg = jnp.clip(-(logp - logp_ref), -20.0, 20.0)
  return jnp.clip(jnp.exp(neg) - neg - 1.0, -10.0, 10.0)


@register_kl("unbiased")
def unbiased_kl(logp: jax.Array, logp_old: jax.Array, logp_ref: jax.Array) -> jax.Array:
  """DeepSeek-V3.2's unbiased KL on samples from pi_old: ratio * (r - log r - 1) with
  ratio = pi_theta / pi_old (gradient flows through it) and r = pi_ref / pi_theta."""
  ratio = jnp.exp(jnp.clip(logp - logp_old, -20.0, 20.0))
  log_r = jnp.clip(logp_ref - logp, -20.0, 20.0)
  return ratio * (jnp.exp(log_r) - log_r - 1.0)


def off_policy_sequence_mask(logp: jax.Array, logp_old: jax.Array, advantages: jax.Array,
                             mask: jax.Array, *, delta: float) -> jax.Array:
  """DeepSeek-V3.2: zero every token of a sequence whose advantage is negative and whose
  mean (logp_old - logp) over its tokens exceeds `delta`. Token-level advantages are reduced
  to the sequence's masked mean. Returns the new [B, T] float mask."""
  m = jnp.asarray(mask, jnp.float32)
  count = jnp.maximum(jnp.sum(m, axis=-1), 1.0)
  seq_kl = jnp.sum((logp_old - logp) * m, axis=-1) / count
  adv = advantages if advantages.ndim == 1 else jnp.sum(advantages * m, axis=-1) / count
  drop = (adv < 0) & (seq_kl > delta)
  return m * (~drop)[:, None]


def value_loss(values: jax.Array, values_old: jax.Array, returns: jax.Array, mask: jax.Array,
               *, clip: float = 0.5, agg: str = "token-mean", **agg_kwargs) -> jax.Array:
  """Clipped value loss: 0.5 * agg(max((v - R)^2, (v_old + clip(v - v_old, -c, c) - R)^2))."""
  v_clip = values_old + jnp.clip(values - values_old, -clip, clip)
  per_token = jnp.maximum((values - returns) ** 2, (v_clip - returns) ** 2)
  return 0.5 * aggregate(per_token, mask, agg, **agg_kwargs)


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
  """1 - Var[R - V] / Var[R] over masked-in tokens (1 = perfect critic, 0 = constant)."""
  m = jnp.asarray(mask, jnp.float32)
  n = jnp.maximum(jnp.sum(m), 1.0)

  def var(x):
    mean = jnp.sum(x * m) / n
    return jnp.sum(((x - mean) * m) ** 2) / n
  return 1.0 - var(returns - values) / jnp.maximum(var(returns), 1e-8)


def dpo_loss(logp_w: jax.Array, logp_l: jax.Array, logp_ref_w: jax.Array,
             logp_ref_l: jax.Array, *, beta: float) -> jax.Array:
  """DPO on sequence log-probs [B]: mean of -log sigmoid(beta * (chosen - rejected margins))."""
  margin = (logp_w - logp_ref_w) - (logp_l - logp_ref_l)
  return -jnp.mean(jax.nn.log_sigmoid(beta * margin))


def bt_loss(r_w: jax.Array, r_l: jax.Array) -> jax.Array:
  """Bradley-Terry reward-model loss: mean of -log sigmoid(r_chosen - r_rejected)."""
  return -jnp.mean(jax.nn.log_sigmoid(r_w - r_l))


def entropy_from_logprobs(logp_all: jax.Array) -> jax.Array:
  """Entropy [..] of distributions given as log-probs [.., V]; -inf entries (tokens outside a
  kept sampling set) contribute 0 rather than NaN."""
  p = jnp.exp(logp_all)
  return -jnp.sum(jnp.where(p > 0, p * logp_all, 0.0), axis=-1)


def response_nll(logits_BTV: jax.Array, tokens_BT: jax.Array, loss_mask_BT: jax.Array, *,
                 mean: bool = True) -> jax.Array:
  """NLL of the masked tokens (token t predicted from position t - 1; in a packed row the first
  token of an example is a prompt token, so no loss crosses a boundary), averaged over them
  (`mean`) or summed."""
  mask = loss_mask_BT[:, 1:]
  nll = -jnp.sum(next_token_logprobs(logits_BTV, tokens_BT) * mask)
  return nll / jnp.maximum(jnp.sum(mask), 1.0) if mean else nll
