"""Losses against hand-computed values (spec sections 1, 2, 4, 5, 7, 9), and the global
token-mean property: micro-batches and data shards that divide by the global counts sum to
the unsplit loss and gradient (the per-micro-batch mean verl shipped does not)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from rl.core import losses

PER_TOKEN = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = jnp.array([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize("mode,kwargs,want", [
    ("token-mean", {}, 7 / 3),
    ("seq-mean-token-mean", {}, (1.5 + 4.0) / 2),
    ("seq-mean-token-sum", {}, 3.5),
    ("seq-mean-token-sum-norm", {"max_len": 4}, 7 / 8),
    ("seq-mean-token-sum-norm", {}, 7 / 6),  # max_len defaults to T
])
def test_aggregate_modes(mode, kwargs, want):
  np.testing.assert_allclose(losses.aggregate(PER_TOKEN, MASK, mode, **kwargs), want, rtol=1e-6)


def test_aggregate_unknown_mode_names_it():
  with pytest.raises(ValueError, match="token-avg"):
    losses.aggregate(PER_TOKEN, MASK, "token-avg")


def _ratios_to_logp(ratios):
  logp_old = jnp.full((1, len(ratios)), -1.0)
  return logp_old + jnp.log(jnp.array([ratios])), logp_old


def test_policy_loss_clip_higher_hand_values():
  logp, logp_old = _ratios_to_logp([1.5, 0.5, 1.1, 0.7])
  a = jnp.array([[1.0, -1.0, -1.0, 1.0]])
  loss, m = losses.policy_loss(logp, logp_old, a, jnp.ones((1, 4)), eps_low=0.2, eps_high=0.28)
  # per token: max(-1.5, -1.28), max(0.5, 0.8), 1.1, max(-0.7, -0.8)
  np.testing.assert_allclose(loss, (-1.28 + 0.8 + 1.1 - 0.7) / 4, atol=1e-6)
  np.testing.assert_allclose([m["clipfrac_high"], m["clipfrac_low"]], [0.25, 0.25])
  np.testing.assert_allclose([m["ratio_max"], m["ratio_min"]], [1.5, 0.5], rtol=1e-6)


def test_policy_loss_dual_clip_bounds_negative_advantage():
  logp, logp_old = _ratios_to_logp([5.0, 5.0])
  a = jnp.array([[-1.0, 1.0]])
  loss, m = losses.policy_loss(logp, logp_old, a, jnp.ones((1, 2)), clip_c=3.0,
                               agg="seq-mean-token-sum")
  # A<0: min(max(5, 1.2), 3) = 3; A>0: max(-5, -1.2) = -1.2.
  np.testing.assert_allclose(loss, 3.0 - 1.2, atol=1e-6)
  np.testing.assert_allclose(m["clipfrac_dual"], 0.5)
  with pytest.raises(ValueError, match="clip_c"):
    losses.policy_loss(logp, logp_old, a, jnp.ones((1, 2)), clip_c=1.0)


def test_policy_gradient_is_zero_on_clipped_tokens():
  logp, logp_old = _ratios_to_logp([1.5, 1.0])
  a = jnp.array([[1.0, 1.0]])
  g = jax.grad(lambda lp: losses.policy_loss(lp, logp_old, a, jnp.ones((1, 2)))[0])(logp)
  np.testing.assert_allclose(g, [[0.0, -0.5]], atol=1e-6)  # d(-A*ratio)/dlogp / N_tok


def test_kl_estimators():
  logp, ref = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.5, 29.0]])
  np.testing.assert_allclose(losses.kl(logp, ref, "k1"), [[0.5, -30.0]])
  np.testing.assert_allclose(losses.kl(logp, ref, "k2"), [[0.125, 450.0]])
  # k3: exp(-0.5) + 0.5 - 1; second entry: -delta = 30 -> clamp 20 -> huge -> clip 10.
  np.testing.assert_allclose(losses.kl(logp, ref, "k3"), [[math.exp(-0.5) - 0.5, 10.0]],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="k4"):
    losses.kl(logp, ref, "k4")


def test_unbiased_kl_value_and_gradient_through_ratio():
  logp, old, ref = jnp.array([-1.0]), jnp.array([-1.2]), jnp.array([-1.5])
  r = math.exp(-0.5)
  np.testing.assert_allclose(losses.unbiased_kl(logp, old, ref),
                             [math.exp(0.2) * (r + 0.5 - 1)], rtol=1e-6)
  # At logp == logp_old: d/dlogp = f + (1 - r) = (r + 0.5 - 1) + 1 - r = 0.5 = logp - logp_ref;
  # with the ratio stopped it would be 1 - r = 0.393.
  g = jax.grad(lambda lp: losses.unbiased_kl(lp, lp * 0 - 1.0, ref).sum())(jnp.array([-1.0]))
  np.testing.assert_allclose(g, [0.5], atol=1e-6)


def test_off_policy_sequence_mask():
  mask = jnp.ones((3, 2))
  logp_old = jnp.zeros((3, 2))
  logp = -jnp.array([[0.3, 0.3], [0.05, 0.05], [0.5, 0.5]])  # seq kl 0.3, 0.05, 0.5
  a = jnp.array([[-1.0, -1.0], [-1.0, -1.0], [1.0, 1.0]])
  keep = losses.off_policy_sequence_mask(logp, logp_old, a, mask, delta=0.1)
  np.testing.assert_array_equal(keep, [[0, 0], [1, 1], [1, 1]])  # only negative + stale drops


def test_value_loss_clipped():
  v, v_old, ret = jnp.array([[1.0, 0.0]]), jnp.zeros((1, 2)), jnp.array([[0.2, 1.0]])
  # t0: max(0.64, (0.5 - 0.2)^2) = 0.64; t1: 1.0 -> 0.5 * mean = 0.41
  np.testing.assert_allclose(losses.value_loss(v, v_old, ret, jnp.ones((1, 2))), 0.41, atol=1e-6)


def test_explained_variance():
  ret = jnp.array([[1.0, 2.0, 3.0, 4.0]])
  np.testing.assert_allclose(losses.explained_variance(ret, ret, jnp.ones((1, 4))), 1.0)
  np.testing.assert_allclose(losses.explained_variance(jnp.full((1, 4), 2.5), ret,
                                                       jnp.ones((1, 4))), 0.0, atol=1e-6)


def test_dpo_and_bt_losses():
  np.testing.assert_allclose(
      losses.dpo_loss(jnp.array([-1.0]), jnp.array([-2.0]), jnp.array([-1.5]),
                      jnp.array([-1.5]), beta=0.1), math.log1p(math.exp(-0.1)), rtol=1e-6)
  np.testing.assert_allclose(losses.bt_loss(jnp.array([2.0, 0.0]), jnp.array([0.0, 0.0])),
                             (math.log1p(math.exp(-2.0)) + math.log(2.0)) / 2, rtol=1e-6)


def test_entropy_ignores_masked_out_vocab():
  logp = jnp.log(jnp.array([[0.5, 0.5, 0.0]]))
  np.testing.assert_allclose(losses.entropy_from_logprobs(logp), [math.log(2.0)], rtol=1e-6)


def _random_batch(seed=0, b=8, t=6):
  rng = np.random.default_rng(seed)
  mask = (rng.random((b, t)) < 0.6).astype(np.float32)
  mask[:, 0] = 1
  logp_old = -rng.random((b, t)).astype(np.float32)
  logp = logp_old + 0.3 * rng.standard_normal((b, t)).astype(np.float32)
  a = rng.standard_normal((b, 1)).astype(np.float32) * mask
  return jnp.asarray(logp), jnp.asarray(logp_old), jnp.asarray(a), jnp.asarray(mask)


@pytest.mark.parametrize("agg", losses.AGG_MODES)
def test_micro_batches_with_global_counts_sum_to_the_full_loss_and_gradient(agg):
  logp, logp_old, a, mask = _random_batch()
  kw = dict(num_tokens=jnp.sum(mask), num_seqs=8.0, max_len=6)

  def loss(lp, rows, **k):
    return losses.policy_loss(lp, logp_old[rows], a[rows], mask[rows], eps_high=0.28,
                              agg=agg, **k)[0]
  full_rows = slice(0, 8)
  full, g_full = jax.value_and_grad(lambda lp: loss(lp, full_rows))(logp)
  parts = [slice(0, 3), slice(3, 8)]  # unequal micro-batches expose per-micro means
  split = sum(loss(logp[s], s, **kw) for s in parts)
  g_split = jnp.concatenate([jax.grad(lambda lp, s=s: loss(lp, s, **kw))(logp[s]) for s in parts])
  np.testing.assert_allclose(split, full, rtol=1e-5)
  np.testing.assert_allclose(g_split, g_full, rtol=1e-5, atol=1e-7)
  if agg == "token-mean":  # the known bug: mean of per-micro-batch means is not the loss
    buggy = sum(loss(logp[s], s) for s in parts) / len(parts)
    assert abs(float(buggy) - float(full)) > 1e-3


def test_token_mean_over_eight_data_shards_equals_unsharded():
  logp, logp_old, a, mask = _random_batch(seed=1, b=16)
  full = losses.policy_loss(logp, logp_old, a, mask)[0]
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

  def shard_loss(lp, lo, adv_, m):
    n = jax.lax.psum(jnp.sum(m), "data")
    return jax.lax.psum(losses.policy_loss(lp, lo, adv_, m, num_tokens=n)[0], "data")
  sharded = jax.shard_map(shard_loss, mesh=mesh, in_specs=(P("data"),) * 4, out_specs=P())
  np.testing.assert_allclose(jax.jit(sharded)(logp, logp_old, a, mask), full, rtol=1e-5)
