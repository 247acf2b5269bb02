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


# ----------------------------------------------------------------------------- Registries


def test_kl_registry_holds_the_spec_estimators():
  """Spec section 4: k1, k2, k3 on samples from pi_theta and DeepSeek-V3.2's unbiased KL, all
  called (logp, logp_old, logp_ref); the config's allowed kl_kind values are these."""
  assert losses.KL_REGISTRY.names() == ("k1", "k2", "k3", "unbiased")
  logp, old, ref = jnp.array([[-1.0, -1.0]]), jnp.array([[-1.2, -0.7]]), jnp.array([[-1.5, 29.0]])
  for kind in ("k1", "k2", "k3"):
    np.testing.assert_array_equal(losses.KL_REGISTRY[kind](logp, old, ref),
                                  losses.kl(logp, ref, kind))
  assert losses.KL_REGISTRY["unbiased"] is losses.unbiased_kl
  with pytest.raises(ValueError, match="unbiased_kl"):
    losses.kl(logp, ref, "unbiased")


def test_policy_loss_registry_holds_the_spec_loss():
  """Spec section 1: the PPO clipped surrogate (Clip-Higher, dual clip), with the config's clip
  range, dual-clip constant (0: off) and aggregation."""
  from rl.core import algorithms
  assert losses.POLICY_LOSS_REGISTRY.names() == ("ppo_clip",)
  assert algorithms.recipe("grpo")["policy_loss"] == "ppo_clip"
  logp, logp_old = _ratios_to_logp([1.5, 0.5, 1.1, 5.0])
  a = jnp.array([[1.0, -1.0, 2.0, -1.0]])
  mask = jnp.ones((1, 4))
  rl = dict(clip_low=0.2, clip_high=0.28, clip_c=0.0, loss_agg_mode="seq-mean-token-sum")
  for clip_c in (0.0, 3.0):
    got = losses.POLICY_LOSS_REGISTRY["ppo_clip"](logp, logp_old, a, mask, dict(rl, clip_c=clip_c),
                                                 num_seqs=2.0)
    want = losses.policy_loss(logp, logp_old, a, mask, eps_low=0.2, eps_high=0.28,
                              clip_c=clip_c or None, agg="seq-mean-token-sum", num_seqs=2.0)
    np.testing.assert_array_equal(got[0], want[0])
    assert jax.tree.map(float, got[1]) == jax.tree.map(float, want[1])


@pytest.mark.parametrize("registry,name,want", [
    (losses.KL_REGISTRY, "k4",
     "config.rl.kl_kind='k4': must be one of ['k1', 'k2', 'k3', 'unbiased']"),
    (losses.POLICY_LOSS_REGISTRY, "gspo",
     "config.rl.policy_loss='gspo': must be one of ['ppo_clip']"),
])
def test_unknown_entry_names_the_field_and_the_entries(registry, name, want):
  """The lookup and the config's validation fail alike, on one line."""
  from rl.core import algorithms
  with pytest.raises(ValueError) as error:
    registry[name]
  assert str(error.value) == want
  field = registry.field.rpartition(".")[2]
  with pytest.raises(ValueError) as error:
    algorithms.validate_rl(dict(algorithms.recipe("grpo"), **{field: name}))
  assert str(error.value) == want


def test_the_update_uses_the_policy_loss_the_config_names(monkeypatch):
  """policy_objective looks config.rl.policy_loss up in the registry: a registered stand-in that
  adds 1 to the PPO loss moves the update's loss by exactly 1."""
  from flax import nnx

  from models.transformer import build
  from rl.core import algorithms
  from rl.core import train_step as ts
  from rl.core.registry import Registry
  registry = Registry("config.rl.policy_loss")
  registry.add("ppo_clip", losses.POLICY_LOSS_REGISTRY["ppo_clip"])

  @registry.register("ppo_clip_plus_one")
  def _plus_one(*args, **kwargs):
    loss, metrics = losses.POLICY_LOSS_REGISTRY["ppo_clip"](*args, **kwargs)
    return loss + 1.0, metrics
  monkeypatch.setattr(losses, "POLICY_LOSS_REGISTRY", registry)

  model = build("tiny_dense", seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rng = np.random.default_rng(0)
  width = 8
  response = np.zeros((2, width), np.float32)
  response[:, 3:] = 1
  batch = {"tokens": rng.integers(0, model.cfg.vocab_size, (2, width), dtype=np.int32),
           "response_mask": response, "attention_mask": np.ones((2, width), np.int32),
           "logp_old": np.full((2, width), -4.0, np.float32),
           "advantages": rng.normal(size=(2, width)).astype(np.float32),
           "acc": np.ones(2, np.float32)}
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  counts = dict(ts.global_counts(batch, algorithms.recipe("grpo")), micro_batches=1.0)

  def loss(name):
    rl = dict(algorithms.recipe("grpo"), kl_coef=0.0, policy_loss=name)
    return float(ts.policy_objective(params, graphdef, rest, batch, counts, rl=rl,
                                     temperature=1.0, max_len=width)[0])
  assert loss("ppo_clip_plus_one") - loss("ppo_clip") == pytest.approx(1.0, abs=1e-5)
