"""Meshes and logical-axis sharding.

Model code names logical axes on every parameter (`logical_axes` metadata: "vocab", "embed",
"heads", "kv_heads", "kv", "mlp", "experts", "q_lora", "kv_lora", "index_heads", "norm");
one rules table maps each logical name to mesh axes. A dimension is sharded over a mesh axis
only when that axis exists, has size > 1, is not already used by another dimension of the same
array, and divides the dimension; otherwise it stays replicated along that axis.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> mesh axes it may be sharded over (in order).
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("index_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("experts", ("expert",)),
    ("q_lora", ()),
    ("kv_lora", ()),
    ("kv", ()),
    ("norm", ()),
)


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all) with axes in MESH_AXES order; one size may be -1."""
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"mesh axes {unknown} unknown; allowed: {MESH_AXES}")
  devices = list(devices if devices is not None else jax.devices())
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"mesh {shape}: at most one axis may be -1")
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f"mesh {shape}: {len(devices)} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f"mesh {shape} needs {int(np.prod(sizes))} devices, have {len(devices)}")
  return Mesh(np.array(devices).reshape(sizes), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules=DEFAULT_RULES) -> PartitionSpec:
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name, dim in zip(axes, shape):
    chosen = []
    size = 1
    for mesh_axis in table.get(name, ()) if name else ():
      n = mesh.shape.get(mesh_axis, 1)
      if n > 1 and mesh_axis not in used and dim % (size * n) == 0:
        chosen.append(mesh_axis)
        size *= n
    used.update(chosen)
    spec.append(tuple(chosen) if len(chosen) > 1 else (chosen[0] if chosen else None))
  return PartitionSpec(*spec)


def state_shardings(state: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
  """NamedShardings for every Variable of an (abstract) nnx State, from its logical axes."""
  def one(var):
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
    if axes is None:
      axes = (None,) * len(value.shape)
    return NamedSharding(mesh, logical_to_spec(axes, value.shape, mesh, rules))
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
