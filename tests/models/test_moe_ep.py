"""Expert dispatches against the dense reference: expert parallelism (models/moe_ep.py) on 8
CPU devices, ragged_dot (TPU / GPU) and `ops_cpu.experts` (weights stacked or per expert)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe, moe_ep, ops, ops_cpu
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
  assert moe_ep.dispatch_for_mesh(ops.ragged_experts) is ops.ragged_experts
  data_mesh = sharding_lib.make_mesh({"data": 8})
  assert moe_ep.dispatch_for_mesh(ops.ragged_experts, data_mesh) is ops.ragged_experts
  mesh = sharding_lib.make_mesh({"expert": 4, "fsdp": 2})
  assert moe_ep.dispatch_for_mesh(ops.ragged_experts, mesh).func is (
      moe_ep.expert_parallel_experts)

  model = build("tiny_moe_mla_dsa", seed=2)
  tokens = jax.random.randint(jax.random.key(3), (4, 12), 0, model.cfg.vocab_size)
  want = jax.jit(lambda t: model.forward(t, moe_dispatch="dense").logits)(tokens)
  used = []
  dispatch = moe_ep.dispatch_for_mesh

  def spy(local_fn, mesh=None, **kwargs):  # MoE.__call__ asks dispatch_for_mesh for experts
    experts = dispatch(local_fn, mesh, **kwargs)
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


def _kept_by_capacity(ids, mesh_shape, capacity_factor):
  """[N, k] bool, by the documented rule and written independently of the dispatch: tokens in
  contiguous blocks over the token shards (the last padded with the last expert); within a
  block, the rows for one destination device in (expert id, token, choice) order; the first
  ceil(capacity_factor * rows per block / P) of them kept."""
  ids = np.asarray(ids)
  n, k = ids.shape
  n_dest = mesh_shape["expert"]
  shards = int(np.prod([s for a, s in mesh_shape.items() if s > 1 and a != "tensor"]))
  per = -(-n // shards)
  capacity = min(per * k, max(1, int(np.ceil(capacity_factor * per * k / n_dest))))
  e_local = N_EXPERTS // n_dest
  kept = np.zeros((n, k), bool)
  for shard in range(shards):
    rows = [(ids[t, j], t, j) for t in range(shard * per, min(n, (shard + 1) * per))
            for j in range(k)]
    rows += [(N_EXPERTS - 1, n + i, 0) for i in range(per * (shard + 1) - max(n, per * shard))
             for _ in range(k)] if shard == shards - 1 else []
    for dest in range(n_dest):
      mine = sorted(r for r in rows if r[0] // e_local == dest)
      for _, t, j in mine[:capacity]:
        if t < n:
          kept[t, j] = True
  return kept


@pytest.mark.parametrize("impl", ["padded", "ragged"])
@pytest.mark.parametrize("shape", MESHES[:2], ids=lambda s: "x".join(f"{k}{v}" for k, v in s.items()))
def test_bounded_exchange_drops_exactly_the_rows_past_capacity(shape, impl, monkeypatch):
  """With a capacity factor that overflows (the balanced load, 1.0, on ids skewed towards low
  experts), the bounded exchange equals dense_experts with the gate weight of exactly the
  assignments past capacity (by `_kept_by_capacity`) set to 0: those rows pass through (zero
  expert output), the rest are computed as dropless; outputs and gradients, fp32 rel <= 1e-5.
  dropped_assignments counts them. Ragged: the collective emulated by all_gather on CPU."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gather)
  mesh = sharding_lib.make_mesh(shape)
  x, ids, weights, *w = _problem(seed=3)
  kept = _kept_by_capacity(ids, shape, 1.0)
  assert 0 < (~kept).sum() < kept.size  # some dropped, some kept
  bounded = functools.partial(moe_ep.expert_parallel_experts, mesh=mesh, impl=impl,
                              capacity_factor=1.0)
  masked = weights * kept

  def loss_bounded(x, weights, *w):
    return _loss(bounded, x, ids, weights, *w)

  def loss_reference(x, weights, *w):
    return _loss(moe.dense_experts, x, ids, weights * kept, *w)

  _assert_close(jax.jit(bounded)(x, ids, weights, *w), moe.dense_experts(x, ids, masked, *w))
  got = jax.jit(jax.grad(loss_bounded, argnums=(0, 2, 3, 4)))(x, weights, *w)
  want = jax.grad(loss_reference, argnums=(0, 2, 3, 4))(x, weights, *w)
  for g, r in zip(got, want):
    _assert_close(g, r)
  assert int(moe_ep.dropped_assignments(ids, N_EXPERTS, mesh, 1.0)) == (~kept).sum()
  # Padding tokens' assignments are dropped or kept like any row but are not counted.
  mask = np.ones(N_TOKENS, bool)
  mask[::2] = False
  assert int(moe_ep.dropped_assignments(ids, N_EXPERTS, mesh, 1.0, jnp.asarray(mask))) == (
      (~kept) & mask[:, None]).sum()


@pytest.mark.parametrize("impl", ["padded", "ragged"])
def test_bounded_exchange_without_overflow_equals_dropless(impl, monkeypatch):
  """A capacity no pair exceeds (dropped_assignments == 0): the bounded exchange, with its
  smaller buffers, gives dropless' outputs and gradients (fp32 rel <= 1e-5); its receive buffer
  is smaller than dropless' in the lowered program."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gather)
  mesh = sharding_lib.make_mesh({"expert": 4, "fsdp": 2})
  args = _problem(seed=4)
  factor = 3.0
  assert int(moe_ep.dropped_assignments(args[1], N_EXPERTS, mesh, factor)) == 0
  bounded = functools.partial(moe_ep.expert_parallel_experts, mesh=mesh, impl=impl,
                              capacity_factor=factor)
  _assert_matches_dense(bounded, args, wrt=(0, 2, 3, 5))
  # 50 tokens over 8 shards: 7 per shard, 14 rows; capacity ceil(3 * 14 / 4) = 11 < 14.
  assert moe_ep.pair_capacity(14, 4, factor) == 11
  assert moe_ep.pair_capacity(14, 4, 0.0) == 14


def test_model_counts_what_its_capacity_drops():
  """The MoE layer under an expert mesh with moe_capacity_factor: each layer's
  router_stats.dropped is dropped_assignments of the ids it routed (0 under the same mesh when
  dropless), and the update's moe_dropped_fraction is their sum over the valid assignments."""
  from rl.core.train_step import add_router_balance
  mesh = sharding_lib.make_mesh({"expert": 4, "fsdp": 2})
  tokens = jax.random.randint(jax.random.key(5), (4, 12), 0, 256)
  outs = {}
  for factor in (0.0, 0.5):
    model = build("tiny_qwen3_moe", seed=2, moe_capacity_factor=factor)
    with jax.set_mesh(mesh):
      outs[factor] = jax.jit(lambda t, m=model: m.forward(t))(tokens)
  assert int(jnp.sum(outs[0.0].router_stats.dropped)) == 0
  out = outs[0.5]
  dropped = out.router_stats.dropped
  n_experts = out.router_stats.tokens_per_expert.shape[-1]
  for layer in range(dropped.shape[0]):
    ids = out.routing[:, :, layer].reshape(-1, out.routing.shape[-1])
    assert int(dropped[layer]) == int(moe_ep.dropped_assignments(ids, n_experts, mesh, 0.5))
  assert int(jnp.sum(dropped)) > 0
  _, metrics = add_router_balance(0.0, {}, out.router_stats, 0.0, 1)
  total = float(jnp.sum(out.router_stats.tokens_per_expert))
  np.testing.assert_allclose(metrics["moe_dropped_fraction"], float(jnp.sum(dropped)) / total)


def test_exchange_is_picked_by_the_target_platform():
  """A TPU (or GPU) program traced on this CPU host takes the ragged exchange the TPU runs:
  ops.expert_exchange reads kernels.platform() (the target set while lowering ahead of time), and the
  lowered MoE layer then contains ragged_all_to_all."""
  import kernels
  assert ops.expert_exchange() == "padded"
  mesh = sharding_lib.make_mesh({"expert": 4, "fsdp": 2})

  def lowered():  # a new function each time: jit's trace cache does not key on the platform
    ep = functools.partial(moe_ep.expert_parallel_experts, mesh=mesh)
    return jax.jit(ep).lower(*_problem()).as_text()

  assert "ragged_all_to_all" not in lowered()
  with kernels.target_platform("tpu"):
    assert ops.expert_exchange() == "ragged"
    assert "ragged_all_to_all" in lowered()


def _cpu_experts_per_expert(x, ids, weights, w_gate, w_up, w_down):
  """ops_cpu.experts on the sampler's layout (`MoE.store_per_expert`): per-expert arrays, each
  expert's gate and up kernels side by side in one [D, 2F] array."""
  gate_up = tuple(jnp.concatenate([g, u], axis=-1) for g, u in zip(w_gate, w_up))
  return ops_cpu.experts(x, ids, weights, gate_up, None, tuple(w_down))


# 16 experts, top 2: on CPU each expert runs on its own tokens, in tiles of 1 row (1 token),
# 2 rows (8 tokens), 16 rows (64) and 32 rows (130); skewed routing: runs of unequal lengths,
# some experts idle.
@pytest.mark.parametrize("n", [1, 8, 64, 130])
@pytest.mark.parametrize("experts", [ops_cpu.experts, _cpu_experts_per_expert,
                                     ops.ragged_experts],
                         ids=["cpu_experts", "cpu_experts_per_expert", "ragged_experts"])
def test_local_dispatch_equals_dense_reference(experts, n):
  """Output and gradients (x, gate weights, every expert weight) equal dense_experts' to fp32
  rounding (relative 1e-5), with the weights stacked or (CPU sampler layout) per expert."""
  _assert_matches_dense(experts, _problem(n=n, n_experts=16))


def test_cpu_experts_when_every_token_picks_the_same_experts():
  """The most skewed routing (64 tokens all on experts 3 and 11: two runs of 8 full tiles, 14
  experts idle) still equals dense_experts, output and gradients."""
  x, ids, *rest = _problem(n=64, n_experts=16)
  ids = jnp.broadcast_to(jnp.array([3, 11], jnp.int32), ids.shape)
  _assert_matches_dense(ops_cpu.experts, (x, ids, *rest))
