"""The RL policy update on 8 CPU devices under five meshes equals the single-device update.

The tiny MoE + MLA + DSA model, a synthetic DAPO mini-batch (prompt/response/padding masks,
behaviour log-probs near the policy's so both clip branches fire, +-1 advantages) and
rl.core.train_step.make_update with two micro-batches: loss, every parameter gradient and the
parameters after one SGD step agree with one device to fp32 rel <= 1e-5. The gradients come
out through the optimiser state (a transform that stores them), so they are the exact
accumulated gradients the update applied, laid out in the parameters' shardings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import sharding as sharding_lib
from models.transformer import build
from rl.core import algorithms
from rl.core import train_step as ts

BATCH, LENGTH, MICRO_BATCHES, LR = 16, 16, 2, 0.5
MESHES = {
    "dp8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "fsdp4_tp2": {"fsdp": 4, "tensor": 2},
    "ep4_fsdp2": {"expert": 4, "fsdp": 2},
    "dp2_fsdp2_tp2": {"data": 2, "fsdp": 2, "tensor": 2},
}
# Two meshes run by default (the expert-parallel one and the 3-axis one); the rest are slow.
DEFAULT_MESHES = ("ep4_fsdp2", "dp2_fsdp2_tp2")


def _record_grads() -> optax.GradientTransformation:
  """Passes gradients through unchanged and keeps the latest ones as its state."""
  return optax.GradientTransformation(
      init=lambda params: jax.tree.map(jnp.zeros_like, params),
      update=lambda grads, state, params=None: (grads, grads))


def _minibatch(vocab: int) -> dict:
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (BATCH, LENGTH), dtype=np.int32)
  prompt_lens = rng.integers(2, 6, BATCH)
  total_lens = rng.integers(LENGTH - 5, LENGTH + 1, BATCH)
  pos = np.arange(LENGTH)[None, :]
  attention = pos < total_lens[:, None]
  response = attention & (pos >= prompt_lens[:, None])
  tokens = np.where(attention, tokens, 0)
  # Behaviour log-probs around the near-uniform initial policy's (-log V): ratios spread
  # over both sides of the clip range.
  logp_old = (-np.log(vocab) + rng.normal(0.0, 0.3, (BATCH, LENGTH))).astype(np.float32)
  acc = rng.integers(0, 2, BATCH).astype(np.float32)
  advantages = np.where(response, (2 * acc - 1)[:, None], 0.0).astype(np.float32)
  return {"tokens": tokens, "response_mask": response.astype(np.float32),
          "attention_mask": attention.astype(np.int32),
          "logp_old": np.where(response, logp_old, 0.0).astype(np.float32),
          "advantages": advantages, "acc": acc}


@pytest.fixture(scope="module")
def setup():
  model = build("tiny_moe_mla_dsa", seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rl = algorithms.recipe("dapo")
  optimizer = optax.chain(_record_grads(), optax.sgd(LR))
  batch = _minibatch(model.cfg.vocab_size)
  host_params = jax.tree.map(np.asarray, params)

  def make(**shardings):
    return ts.make_update(ts.policy_objective, graphdef, optimizer,
                          micro_batches=MICRO_BATCHES, rl=rl, temperature=1.0,
                          max_len=LENGTH, **shardings)

  update = make()
  state = ts.init_state(jax.tree.map(jnp.asarray, host_params), optimizer)
  new_state, metrics = update(state, rest, jax.tree.map(jnp.asarray, batch))
  reference = jax.tree.map(np.asarray, (new_state.params, new_state.opt_state[0], metrics))
  return dict(make=make, batch=batch, params=host_params, optimizer=optimizer,
              reference=reference, rest=rest)


def _assert_tree_close(got, want, what, rel=1e-5):
  got_leaves = jax.tree_util.tree_leaves_with_path(got)
  want_leaves = jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for (path, g), w in zip(got_leaves, want_leaves):
    g, w = np.asarray(g), np.asarray(w)
    scale = float(np.max(np.abs(w))) if w.size else 0.0
    np.testing.assert_allclose(g, w, rtol=rel, atol=rel * scale,
                               err_msg=f"{what} {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n in DEFAULT_MESHES else pytest.mark.slow) for n in MESHES])
def test_sharded_update_matches_single_device(setup, name, expert_parallel_choices):
  """On mesh `name`, one update (parameters born sharded by their logical axes, the batch
  sharded over the batch axes, expert-parallel MoE dispatch where the mesh has an expert
  axis) gives the single-device loss, gradients and SGD-updated parameters (rel <= 1e-5)."""
  mesh = sharding_lib.make_mesh(MESHES[name])
  expert_parallel = expert_parallel_choices  # MoE's choice from the ambient mesh

  param_shardings = sharding_lib.state_shardings(setup["params"], mesh)
  params = jax.device_put(setup["params"], param_shardings)
  state = jax.jit(lambda p: ts.init_state(p, setup["optimizer"]))(params)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  batch_sharding = {
      k: sharding_lib.logical_sharding(("batch",) + (None,) * (v.ndim - 1), v.shape, mesh)
      for k, v in setup["batch"].items()}
  batch = jax.device_put(setup["batch"], batch_sharding)
  update = setup["make"](state_sharding=state_sharding, batch_sharding=batch_sharding)
  with jax.set_mesh(mesh):
    new_state, metrics = update(state, setup["rest"], batch)

  want_params, want_grads, want_metrics = setup["reference"]
  assert float(metrics["skipped"]) == 0.0
  np.testing.assert_allclose(float(metrics["loss"]), want_metrics["loss"], rtol=1e-5)
  _assert_tree_close(new_state.opt_state[0], want_grads, "gradient")
  _assert_tree_close(new_state.params, want_params, "updated parameter")
  assert not batch["tokens"].sharding.is_fully_replicated
  assert expert_parallel and all(expert_parallel) == (MESHES[name].get("expert", 1) > 1)
  if any(MESHES[name].get(axis, 1) > 1 for axis in ("fsdp", "tensor", "expert")):
    # The comparison really ran on sharded parameters, and no big one stayed replicated.
    n_sharded = sum(not x.sharding.is_fully_replicated
                    for x in jax.tree.leaves(new_state.params))
    assert n_sharded > 5
    sharding_lib.check_not_replicated(new_state.params, param_shardings, min_bytes=64 << 10)


def test_misnamed_batch_field_is_refused(setup):
  """The update refuses a mini-batch with an unknown key (a misspelt "kept_ids" once
  switched keep-sampling-mask off without a word) or without a field it always reads."""
  update = setup["make"]()
  state = ts.init_state(jax.tree.map(jnp.asarray, setup["params"]), setup["optimizer"])
  batch = {k: jnp.asarray(v) for k, v in setup["batch"].items()}
  with pytest.raises(ValueError, match=r"unknown fields \['kept_id'\]"):
    update(state, setup["rest"], dict(batch, kept_id=batch["tokens"]))
  with pytest.raises(ValueError, match=r"missing fields \['acc'\]"):
    update(state, setup["rest"], {k: v for k, v in batch.items() if k != "acc"})
