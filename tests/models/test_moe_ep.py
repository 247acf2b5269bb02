"""Expert dispatches against the dense reference: expert parallelism (models/moe_ep.py) on 8
CPU devices, ragged_dot (TPU / GPU) and `cpu_experts` (each of its three forms)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe, moe_ep
from models import sharding as sharding_lib
from models.transformer import build

N_TOKENS, DIM, HIDDEN, N_EXPERTS, TOP_K = 50, 16, 12, 8, 2  # 50: not a multiple of 8 shards


def _problem(seed=0, n=N_TOKENS, n_experts=N_EXPERTS):
  keys = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(keys[0], (n, DIM))
  # Distinct experts per token, skewed towards low ids so some devices receive far more rows.
  logits = jax.random.normal(keys[1], (n, n_experts)) - 0.5 * jnp.arange(n_experts)
  ids = jax.lax.top_k(logits, TOP_K)[1].astype(jnp.int32)
  weights = jax.random.uniform(keys[2], (n, TOP_K))
  w_gate = 0.3 * jax.random.normal(keys[3], (n_experts, DIM, HIDDEN))
  w_up = 0.3 * jax.random.normal(keys[4], (n_experts, DIM, HIDDEN))
  w_down = 0.3 * jax.random.normal(keys[5], (n_experts, HIDDEN, DIM))
  return x, ids, weights, w_gate, w_up, w_down


def _loss(experts, x, ids, weights, w_gate, w_up, w_down):
  return jnp.sum(jnp.sin(experts(x, ids, weights, w_gate, w_up, w_down)))


def _assert_close(actual, expected, rel=1e-5):
  actual, expected = np.asarray(actual), np.asarray(expected)
  np.testing.assert_allclose(actual, expected, rtol=rel, atol=rel * np.max(np.abs(expected)))


def _assert_matches_dense(experts, args, wrt=(0, 2, 3, 4, 5)):
  """experts(*args) and its gradients w.r.t. `wrt` equal dense_experts' (fp32 rel <= 1e-5)."""
  _assert_close(jax.jit(experts)(*args), moe.dense_experts(*args))
  grads = jax.jit(jax.grad(functools.partial(_loss, experts), argnums=wrt))(*args)
  ref = jax.grad(functools.partial(_loss, moe.dense_experts), argnums=wrt)(*args)
  for got, want in zip(grads, ref):
    _assert_close(got, want)


def _ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, *, axis_name):
  """The documented semantics of jax.lax.ragged_all_to_all, built from all_gather (which
  XLA:CPU runs): row r of my output comes from source q when it lies in the slice q sends me."""
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  operands = jax.lax.all_gather(operand, axis_name)
  starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]
  sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
  lands = jax.lax.all_gather(output_offsets, axis_name)[:, me]
  row = jnp.arange(output.shape[0])
  for q in range(operands.shape[0]):
    inside = (row >= lands[q]) & (row < lands[q] + sizes[q])
    src = jnp.clip(starts[q] + row - lands[q], 0, operand.shape[0] - 1)
    output = jnp.where(inside[:, None], operands[q][src], output)
  return output


MESHES = [{"expert": 8}, {"expert": 4, "fsdp": 2}, {"expert": 2, "data": 2, "tensor": 2}]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_padded_all_to_all_matches_dense_forward_and_backward(shape):
  """The padded all_to_all path (XLA:CPU) equals dense_experts: output and jax.grad w.r.t. x,
  gate weights and all three expert weights, fp32 rel <= 1e-5; also with the expert FFN's
  hidden dim sharded over "tensor" and a token count that the mesh does not divide."""
  mesh = sharding_lib.make_mesh(shape)
  args = _problem()
  _assert_matches_dense(
      functools.partial(moe_ep.expert_parallel_experts, mesh=mesh, impl="padded"), args)


def test_ragged_path_bookkeeping_matches_dense(monkeypatch):
  """The ragged_all_to_all path's offsets and sizes (forward and the return trip) are right:
  with ragged_all_to_all replaced by an all_gather emulation of its documented semantics,
  output and gradients equal dense_experts (fp32 rel <= 1e-5). The real collective needs a
  GPU/TPU backend."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gather)
  mesh = sharding_lib.make_mesh({"expert": 4, "fsdp": 2})
  args = _problem(seed=1)
  _assert_matches_dense(
      functools.partial(moe_ep.expert_parallel_experts, mesh=mesh, impl="ragged"), args,
      wrt=(0, 2, 3, 5))


def test_dispatch_for_mesh_uses_ambient_expert_axis(monkeypatch):
  """dispatch_for_mesh keeps the local function without an expert axis and switches to
  expert parallelism under jax.set_mesh with expert > 1; through MoE.__call__ in the tiny
  MoE+MLA+DSA model, the logits equal the dense-dispatch model's."""
  assert moe_ep.dispatch_for_mesh(moe.ragged_experts) is moe.ragged_experts
  data_mesh = sharding_lib.make_mesh({"data": 8})
  assert moe_ep.dispatch_for_mesh(moe.ragged_experts, data_mesh) is moe.ragged_experts
  mesh = sharding_lib.make_mesh({"expert": 4, "fsdp": 2})
  assert moe_ep.dispatch_for_mesh(moe.ragged_experts, mesh).func is (
      moe_ep.expert_parallel_experts)

  model = build("tiny_moe_mla_dsa", seed=2)
  tokens = jax.random.randint(jax.random.key(3), (4, 12), 0, model.cfg.vocab_size)
  want = jax.jit(lambda t: model.forward(t, moe_dispatch="dense").logits)(tokens)
  used = []
  dispatch = moe_ep.dispatch_for_mesh

  def spy(local_fn, mesh=None):  # MoE.__call__ asks dispatch_for_mesh for its experts
    experts = dispatch(local_fn, mesh)
    used.append(experts is not local_fn)
    return experts

  monkeypatch.setattr(moe_ep, "dispatch_for_mesh", spy)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda t: model.forward(t, moe_dispatch="ragged").logits)(tokens)
  assert used and all(used)
  _assert_close(got, want)


def test_real_ragged_all_to_all_path_lowers():
  """With the real jax.lax.ragged_all_to_all, the ragged path type-checks under shard_map's
  varying-axis checks and lowers to StableHLO, forward and backward (XLA:CPU cannot compile
  the collective; GPU/TPU run it)."""
  mesh = sharding_lib.make_mesh({"expert": 4, "fsdp": 2})
  args = _problem()
  ep = functools.partial(moe_ep.expert_parallel_experts, mesh=mesh, impl="ragged")
  assert "ragged_all_to_all" in jax.jit(ep).lower(*args).as_text()
  grad = jax.jit(jax.grad(functools.partial(_loss, ep), argnums=(0, 3)))
  assert grad.lower(*args).as_text().count("ragged_all_to_all") >= 4


# 16 experts, top 2: one token's experts are an eighth (gathered); 8 and 64 tokens: every expert
# at once; 130: three chunks of 64, the last padded.
@pytest.mark.parametrize("n", [1, 8, 64, 130])
@pytest.mark.parametrize("experts", [moe.cpu_experts, moe.ragged_experts],
                         ids=["cpu_experts", "ragged_experts"])
def test_local_dispatch_equals_dense_reference(experts, n):
  """Output and gradients (x, gate weights, every expert weight) equal dense_experts' to fp32
  rounding (relative 1e-5)."""
  _assert_matches_dense(experts, _problem(n=n, n_experts=16))
