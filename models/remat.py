"""Rematerialisation and host offload: how the training step trades device memory for
recomputation or host transfers.

Activations. The body of the scan over each stack of decoder layers (models/transformer.py)
runs under `jax.checkpoint` with the policy `ModelConfig.remat` names (`REMAT_POLICIES`): what
the backward pass keeps from the forward of each layer, the rest being recomputed layer by
layer. Under "full" that is the layer's input alone (the scan's carry, [B, T, D] per layer).

  none                   keep everything (no checkpoint)
  full                   keep only each layer's input (`nothing_saveable`): one extra forward
  dots                   keep matmul outputs (`dots_saveable`), recompute the element-wise ops
  dots_no_batch          keep matmuls without batch dimensions (the projections, not the
                         attention scores) (`dots_with_no_batch_dims_saveable`)
  names                  keep the tensors tagged with the `ModelConfig.remat_names`
                         (`save_only_these_names`; tags in `CHECKPOINT_NAMES`)
  offload_names          as `names`, the tagged tensors moved to pinned host memory
                         (`save_and_offload_only_these_names`)
  offload_dots_no_batch  as `dots_no_batch`, moved to pinned host memory
                         (`offload_dot_with_no_batch_dims`)

Optimiser state. `host_shardings` gives the optimiser state's shardings in pinned host memory;
rl/core/train_step.py `make_update(..., offload_optimizer=True)` keeps the state there between steps
and brings it onto the device only for the update.

XLA:CPU has device, pinned_host and unpinned_host memories (`addressable_memories()`), so
offloading compiles and runs there with unchanged values; but host and device are the same RAM
and the memory analysis does not split them, so the saving shows only on GPU / TPU. XLA:CPU also
expands the optimisation barriers that keep a rematerialised forward next to its backward before
it schedules, and then common-subexpression elimination merges the recomputation back into the
forward: remat changes nothing on CPU unless compiled with `CPU_KEEP_REMAT` (the GPU and TPU
pipelines keep the barriers).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.ad_checkpoint import checkpoint_name

REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "names", "offload_names",
                  "offload_dots_no_batch")
# Activations models/transformer.py DecoderLayer tags with `checkpoint_name`.
CHECKPOINT_NAMES = ("attn_in", "attn_out", "mlp_in", "mlp_out")
# Compiler options that keep XLA:CPU from undoing rematerialisation (see the module docstring).
CPU_KEEP_REMAT = {"xla_disable_hlo_passes": "cse_barrier_expander"}

HOST_MEMORY = "pinned_host"
DEVICE_MEMORY = "device"


def parse_names(names: str) -> tuple[str, ...]:
  """The tag names of a comma-separated `ModelConfig.remat_names`."""
  return tuple(n.strip() for n in names.split(",") if n.strip())


def check_policy(remat: str, remat_names: str) -> str | None:
  """Why (`remat`, `remat_names`) is not a valid choice, or None."""
  if remat not in REMAT_POLICIES:
    return f"must be one of {REMAT_POLICIES}"
  names = parse_names(remat_names)
  unknown = sorted(set(names) - set(CHECKPOINT_NAMES))
  if unknown:
    return f"remat_names {unknown} unknown; the model tags {CHECKPOINT_NAMES}"
  if remat in ("names", "offload_names") and not names:
    return f"remat={remat!r} needs remat_names (comma-separated, from {CHECKPOINT_NAMES})"
  return None


def policy(remat: str, remat_names: str = "") -> Callable[..., Any] | None:
  """The `jax.checkpoint` policy of a `REMAT_POLICIES` entry (None for "none")."""
  why = check_policy(remat, remat_names)
  if why:
    raise ValueError(f"remat={remat!r}: {why}")
  policies = jax.checkpoint_policies
  names = list(parse_names(remat_names))
  if remat == "none":
    return None
  if remat == "full":
    return policies.nothing_saveable
  if remat == "dots":
    return policies.dots_saveable
  if remat == "dots_no_batch":
    return policies.dots_with_no_batch_dims_saveable
  if remat == "names":
    return policies.save_only_these_names(*names)
  if remat == "offload_names":
    return policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=names,
        offload_src=DEVICE_MEMORY, offload_dst=HOST_MEMORY)
  return policies.offload_dot_with_no_batch_dims(DEVICE_MEMORY, HOST_MEMORY)


def tag(x: jax.Array, name: str) -> jax.Array:
  """Names an activation for the name-based policies (identity outside a checkpoint)."""
  return checkpoint_name(x, name)


def host_shardings(shardings: Any) -> Any:
  """The same shardings (a pytree of NamedSharding) in pinned host memory."""
  return jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings)


def device_shardings(shardings: Any) -> Any:
  """The same shardings (a pytree of NamedSharding) in device memory."""
  return jax.tree.map(lambda s: s.with_memory_kind(DEVICE_MEMORY), shardings)


def host_memory_supported(device: jax.Device | None = None) -> bool:
  """Whether `device` (default: the first) can address pinned host memory."""
  device = device or jax.devices()[0]
  return any(m.kind == HOST_MEMORY for m in device.addressable_memories())
