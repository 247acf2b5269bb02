"""Where a training run's arrays live: the device mesh of `config.mesh`, the policy's parameters
and optimiser state sharded by their logical axes, and host batches split over the batch axes.

One Placement per run (rl/jobs/trainer.py, rl/jobs/sft.py):

  placement = Placement.from_config(config)      # mesh from config.mesh (or the planner's)
  state = placement.train_state(params, optimizer, offload=config.optim.offload_state)
  update = make_update(..., state_sharding=placement.state_sharding(state), offload_...)
  with placement.scope():                         # ambient mesh: MoE picks expert parallelism
    state, metrics = update(state, placement.put_batch(host_batch))

The mesh uses the first `config.mesh.devices` local devices (0: all of them) with the axis
sizes of `config.mesh.shape` (one may be -1: the devices left over; the default puts them all
on "data") and `config.mesh.dcn`; with `config.mesh.auto` the sizes are those of the best plan
of models/planner.py for this config, device count and `config.mesh.device_kind`.

Parameters are placed by their logical axes (models/sharding.py); an optimiser state's
parameter-shaped subtrees (Adam's moments) follow the parameters and the rest (step counts) is
replicated; `offload` keeps the optimiser state in pinned host memory between updates. Batches
are built on the host, identical in every process, and each device takes its slice
(`jax.make_array_from_callback`), so a training step sees global arrays.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import memory, planner
from models import remat as remat_lib
from models import sharding as sharding_lib
from rl.core.batching import batching
from rl.core.checks import InputError, allowed
from rl.core.policy import model_config
from rl.core.sampling import kept_ids_width
from rl.core import algorithms
from rl.core import train_step as ts


def check_mesh(mesh: ml_collections.ConfigDict) -> None:
  """config.mesh's checker (what `Placement.from_config` reads): ValueError naming the field."""
  for table in ("shape", "dcn"):
    sizes = mesh[table]
    unknown = sorted(set(sizes) - set(sharding_lib.MESH_AXES))
    if unknown:
      raise ValueError(f"config.mesh.{table}: unknown axes {unknown}; allowed: "
                       f"{list(sharding_lib.MESH_AXES)}")
    for axis, size in sizes.items():
      if size < 1 and not (table == "shape" and size == -1):
        rule = "positive or -1 (the devices left over)" if table == "shape" else ">= 1"
        raise ValueError(f"config.mesh.{table}.{axis}={size}: must be {rule}")
  if list(mesh.shape.values()).count(-1) > 1:
    raise ValueError(f"config.mesh.shape={mesh.shape.to_dict()}: at most one axis may be -1")
  if mesh.devices < 0:
    raise ValueError(f"config.mesh.devices={mesh.devices}: must be >= 0 (0: the local "
                     "device count)")
  if mesh.device_kind:
    allowed("mesh.device_kind", mesh.device_kind, sorted(planner.DEVICES))
  sharding_lib.make_rules(mesh.rules)


def check_devices(mesh: ml_collections.ConfigDict) -> None:
  """config.mesh against this machine's devices, at run start once the JAX runtime is joined
  (check_mesh cannot: a dry run passes it while planning a mesh larger than its host):
  InputError naming the field when config.mesh.devices exceeds the devices here, or when the
  shape and dcn sizes do not make a mesh of the devices the run uses."""
  available = jax.device_count()
  n = mesh.devices or available
  if n > available:
    raise InputError(f"config.mesh.devices={mesh.devices}: only {available} devices here")
  if mesh.auto:
    return  # the planner picks the shape for n devices
  try:
    sharding_lib.mesh_from_config(dict(mesh.shape.to_dict(), dcn=mesh.dcn.to_dict()),
                                  jax.devices()[:n])
  except ValueError as e:
    raise InputError(f"config.mesh.shape / config.mesh.dcn do not fit the {n} devices of this "
                     f"run: {e}") from None


def workload(config, *, prompt_len: int | None = None) -> planner.Workload:
  """The planner's Workload of a run config (the sequence length launch/dry_run.py assumes);
  the rollout decodes all of a step's sequences at once unless config.rollout.batch_size says
  less, prefills each prompt once for its samples, and records `kept_ids` ids per token with keep-sampling-mask (rl/core/sampling.py
  kept_ids_width: the batch field's width)."""
  cfg = model_config(config)
  if prompt_len is None:
    prompt_len = memory.default_prompt_len(cfg, config.rollout.max_new_tokens)
  length = prompt_len + config.rollout.max_new_tokens
  backend = config.kernel_backend
  rl, r = config.rl, config.rollout
  sequences = config.train.prompts_per_step * config.train.samples_per_prompt
  # Streaming rounds continue partial responses: no shared prefill (aot.rollout_shape).
  group = 1 if config.rollout.streaming.enabled else config.train.samples_per_prompt
  b = batching(config.rollout.batch_size, config.rollout.prefill_batch, sequences,
               group_size=group)
  return planner.Workload(
      sequences=sequences, length=length, mini_batches=config.train.mini_batches,
      micro_batches=config.train.micro_batches, rollout_length=length,
      rollout_sequences=b["slots"], prompt_len=prompt_len,
      prefill_rows=b["refill_contexts"], keep_routing=bool(rl.keep_routing),
      reference=algorithms.kl_on(rl), critic=algorithms.needs_critic(rl),
      kernel_backend=backend if backend in ("reference", "interpret") else "compiled",
      offload_optimizer=bool(config.optim.offload_state),
      kept_ids=kept_ids_width(top_p=r.top_p, top_k=r.top_k, greedy=r.temperature == 0,
                              vocab_size=cfg.vocab_size, max_kept=r.max_kept_ids)
      if rl.keep_sampling_mask else 0)


def best_mesh(config, devices: int, device: planner.DeviceSpec) -> planner.Plan:
  """The planner's best plan for a run config keeping its own remat policy and optimiser
  placement: what `config.mesh.auto=True` uses."""
  cfg = model_config(config)
  work = workload(config)
  return planner.plan(cfg, work, devices, device, remats=(cfg.remat,),
                      offload_optimizer=(work.offload_optimizer,),
                      rules=sharding_lib.make_rules(config.mesh.rules))[0]


class Placement:
  """A run's mesh and how its parameters, optimiser state and batches are laid out on it."""

  def __init__(self, mesh: Mesh, plan=None, rules=sharding_lib.DEFAULT_RULES):
    self.mesh = mesh
    self.plan = plan  # the models/planner.py Plan the mesh came from (config.mesh.auto)
    self.rules = rules  # logical axis -> mesh axes (config.mesh.rules)
    self.replicated = NamedSharding(mesh, PartitionSpec())

  @classmethod
  def from_config(cls, c: ml_collections.ConfigDict) -> "Placement":
    check_devices(c.mesh)
    n = c.mesh.devices or jax.device_count()
    shape, plan = c.mesh.shape.to_dict(), None
    if c.mesh.auto:
      plan = best_mesh(c, n, planner.device_kind(c.mesh.device_kind))
      shape = plan.mesh
      logging.info("config.mesh.auto: planned mesh %s (remat %s, %.1f GiB peak per device)\n%s",
                   plan.mesh, plan.remat, plan.memory["peak"] / 2**30,
                   "\n".join(planner.format_table([plan])))
    mesh = sharding_lib.mesh_from_config(dict(shape, dcn=c.mesh.dcn.to_dict()),
                                         jax.devices()[:n])
    logging.info("mesh %s over %d %s device(s)",
                 {k: v for k, v in mesh.shape.items() if v > 1} or "(one device)", mesh.size,
                 mesh.devices.flat[0].platform)
    return cls(mesh, plan, sharding_lib.make_rules(c.mesh.rules))

  @property
  def size(self) -> int:
    return self.mesh.size

  @property
  def rollout_mesh(self) -> Mesh | None:
    """The mesh the rollout engine shards its slots over (None on one device)."""
    return self.mesh if self.mesh.size > 1 else None

  def scope(self):
    """The ambient mesh (`jax.set_mesh`) for tracing and running the model: the MoE layer
    takes expert parallelism from it. A one-device mesh needs none."""
    return jax.set_mesh(self.mesh) if self.mesh.size > 1 else contextlib.nullcontext()

  # ------------------------------------------------------------------ Parameters and state
  def param_shardings(self, params: Any) -> Any:
    return sharding_lib.state_shardings(params, self.mesh, self.rules)

  def put_params(self, params: Any) -> Any:
    """`params` (an nnx State, on any device or the host) laid out by their logical axes."""
    return jax.device_put(params, self.param_shardings(params))

  def train_state(self, params: Any, optimizer: optax.GradientTransformation, *,
                  offload: bool = False) -> ts.TrainState:
    """A fresh TrainState of `params`: parameters placed, optimiser state created in place
    (in pinned host memory with `offload`)."""
    params = self.put_params(params)
    abstract = jax.eval_shape(optimizer.init, params)
    shardings = sharding_lib.optimizer_shardings(abstract, params,
                                                 self.param_shardings(params), self.mesh)
    if offload:
      shardings = remat_lib.host_shardings(shardings)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), self.replicated)
    return ts.TrainState(params, opt_state, step)

  def state_sharding(self, state: ts.TrainState) -> ts.TrainState:
    """The device layout of a TrainState (what `make_update(state_sharding=)` takes; an
    offloaded optimiser state is given by its device twin)."""
    return remat_lib.device_shardings(jax.tree.map(lambda x: x.sharding, state))

  # ------------------------------------------------------------------ Batches
  def batch_sharding(self, shape: tuple[int, ...]) -> NamedSharding:
    """Rows over the batch axes (data, fsdp, expert) where they divide the row count."""
    return sharding_lib.logical_sharding(("batch",) + (None,) * (len(shape) - 1), shape,
                                         self.mesh)

  def put_batch(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """Host arrays (the same in every process) as global arrays, rows split over the mesh."""
    return {k: sharding_lib.put_global(v, self.batch_sharding(np.shape(v)))
            for k, v in batch.items()}

  def warn_unsplit_rows(self, rows: int, what: str) -> bool:
    """Logs a warning (and returns True) when `rows` do not split over the batch axes: they
    are then replicated over those axes, every device repeating the same rows' compute."""
    ways = math.prod(self.mesh.shape[a] for a in sharding_lib.ROW_AXES)
    if rows % ways == 0:
      return False
    logging.warning("%s of %d rows does not split over the mesh's batch axes (data x fsdp x "
                    "expert = %d): those rows are replicated and their compute repeated on "
                    "every device; make it a multiple of %d", what, rows, ways, ways)
    return True
