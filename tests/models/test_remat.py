"""Rematerialisation and host offload (models/remat.py): the RL policy objective's loss and
gradients are unchanged by every policy, XLA's compiled temporaries shrink in the expected
direction, the activation offload asks for host memory, and the optimiser state offloaded to
pinned host memory gives the same update. On XLA:CPU host and device memory are one RAM, so
the byte savings of offloading are checked only on GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import remat
from models import transformer
from models.config import get_config
from rl.core import algorithms
from rl.core import train_step as ts

LENGTH = 128  # long enough that activations dominate the tiny model's memory
RL = algorithms.recipe("dapo")


def rl_batch(rows: int = 2, length: int = LENGTH) -> dict:
  keys = jax.random.split(jax.random.key(1), 3)
  response = (jnp.arange(length) >= length // 4).astype(jnp.float32)
  return {"tokens": jax.random.randint(keys[0], (rows, length), 0, 264),
          "response_mask": jnp.broadcast_to(response, (rows, length)),
          "attention_mask": jnp.ones((rows, length)),
          "logp_old": -3.0 + 0.1 * jax.random.normal(keys[1], (rows, length)),
          "advantages": jax.random.normal(keys[2], (rows, 1)) * jnp.ones((rows, length)),
          "acc": jnp.ones((rows,))}


def objective_and_grad(remat_policy: str, batch: dict):
  """(compiled value_and_grad of rl/train_step.policy_objective, params); compiled so that
  XLA:CPU keeps the rematerialisation (remat.CPU_KEEP_REMAT)."""
  model = transformer.build("tiny_dense", n_layers=2, remat=remat_policy)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  counts = dict(ts.global_counts(batch, RL), micro_batches=jnp.ones(()))

  def loss(params):
    return ts.policy_objective(params, graphdef, rest, batch, counts, rl=RL, temperature=1.0,
                               max_len=LENGTH)[0]
  lowered = jax.jit(jax.value_and_grad(loss)).lower(params)
  return lowered.compile(compiler_options=remat.CPU_KEEP_REMAT), params


@pytest.fixture(scope="module")
def runs():
  batch = rl_batch()
  out = {}
  for name in ("none", "full", "dots", "offload_names"):
    compiled, params = objective_and_grad(name, batch)
    loss, grads = compiled(params)
    out[name] = dict(loss=loss, grads=grads,
                     temp=compiled.memory_analysis().temp_size_in_bytes)
  return out


def test_policies_keep_loss_and_gradients(runs):
  """fp32: every policy gives the no-remat loss and gradients to 1e-6."""
  ref = runs["none"]
  for name, run in runs.items():
    assert abs(float(run["loss"] - ref["loss"])) <= 1e-6, name
    for got, want in zip(jax.tree.leaves(run["grads"]), jax.tree.leaves(ref["grads"])):
      np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=name)


def test_remat_shrinks_compiled_temporaries(runs):
  """Full remat keeps only layer inputs, `dots` the matmul outputs: both need less temporary
  memory than keeping everything, full the least of the two."""
  temp = {name: run["temp"] for name, run in runs.items()}
  assert temp["full"] < temp["dots"] < temp["none"], temp
  assert temp["full"] < 0.6 * temp["none"], temp


def test_activation_offload_moves_saved_names_to_host(runs):
  """The offload policy's backward pass reads the tagged activations from pinned host memory
  (device_put to the host space in the traced program) and needs no more device memory than
  recomputing them."""
  model = transformer.build("tiny_dense", n_layers=1, remat="offload_names")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jnp.zeros((1, 16), jnp.int32)
  jaxpr = str(jax.make_jaxpr(jax.grad(
      lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(tokens))))(params))
  assert "MemorySpace.Host" in jaxpr
  assert runs["offload_names"]["temp"] < runs["none"]["temp"]


def test_config_rejects_unknown_policies_and_names():
  cfg = get_config("tiny_dense")
  with pytest.raises(ValueError, match="ModelConfig.remat='sometimes'"):
    cfg.replace(remat="sometimes")
  with pytest.raises(ValueError, match="remat_names"):
    cfg.replace(remat="names", remat_names="attn_out,qkv")
  with pytest.raises(ValueError, match="needs remat_names"):
    cfg.replace(remat="offload_names", remat_names="")
  assert remat.policy("none") is None
  for name in remat.REMAT_POLICIES[1:]:
    assert callable(remat.policy(name, "attn_out"))


def adam_update(offload: bool):
  """One make_update step of the tiny model with the optimiser state on host or device."""
  model = transformer.build("tiny_dense", n_layers=1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  optimizer = ts.make_optimizer(lr=1e-2, warmup_steps=1, weight_decay=0.0, grad_clip=1.0)
  state = ts.init_state(params, optimizer)
  mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:1])
  sharding = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state)
  if offload:
    state = state._replace(opt_state=jax.device_put(
        state.opt_state, remat.host_shardings(sharding.opt_state)))
  update = ts.make_update(ts.policy_objective, graphdef, optimizer, micro_batches=1,
                          rl=RL, state_sharding=sharding, offload_optimizer=offload,
                          temperature=1.0, max_len=16)
  batch = rl_batch(rows=2, length=16)
  compiled = update.lower(state, rest, batch).compile()
  for _ in range(2):
    state, metrics = compiled(state, rest, batch)
  return state, metrics, compiled.memory_analysis()


@pytest.mark.skipif(not remat.host_memory_supported(), reason="no pinned host memory here")
def test_optimizer_offload_keeps_values_and_lives_on_host():
  """Two AdamW steps with the optimiser state in pinned host memory equal the on-device ones,
  and the returned state is still on the host."""
  on_device, metrics, _ = adam_update(False)
  on_host, host_metrics, _ = adam_update(True)
  assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(on_host.opt_state)} == {
      remat.HOST_MEMORY}
  assert float(host_metrics["loss"]) == pytest.approx(float(metrics["loss"]), abs=1e-6)
  for got, want in zip(jax.tree.leaves((on_host.params, on_host.opt_state)),
                       jax.tree.leaves((on_device.params, on_device.opt_state))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=0)


def test_optimizer_offload_needs_shardings():
  with pytest.raises(ValueError, match="needs state_sharding"):
    ts.make_update(ts.policy_objective, None, None, micro_batches=1, rl=RL,
                   offload_optimizer=True)


@pytest.mark.gpu
def test_offload_frees_device_memory_on_gpu():
  """On a GPU, host memory is separate: the offloaded optimiser state leaves the device's
  argument bytes and the offloaded activations leave its temporaries. (XLA:CPU reports host
  and device as one memory, so this cannot be checked there.)"""
  _, _, on_device = adam_update(False)
  _, _, on_host = adam_update(True)
  assert on_host.host_argument_size_in_bytes > 0
  assert on_host.argument_size_in_bytes < on_device.argument_size_in_bytes
  batch = rl_batch()
  names, _ = objective_and_grad("names", batch)
  offloaded, _ = objective_and_grad("offload_names", batch)
  assert (offloaded.memory_analysis().temp_size_in_bytes
          < names.memory_analysis().temp_size_in_bytes)
