"""Meshes and logical-axis sharding.

Model code names logical axes on every parameter (`logical_axes` metadata: "vocab", "embed",
"heads", "kv_heads", "kv", "mlp", "experts", "q_lora", "kv_lora", "index_heads", "norm", and "layers",
the leading axis of a stack of scanned layers);
activations use "batch" and "length". One rules table maps each logical name to mesh axes. A
dimension is sharded over a mesh axis only when that axis exists, has size > 1, is not already
used by another dimension of the same array, and divides the dimension; otherwise it stays
replicated along that axis.

Meshes have the axes (data, fsdp, expert, tensor), outermost first: the innermost
axis gets the closest devices, so tensor parallelism (the chattiest) stays inside a chip
group. `mesh_from_config` also takes across-slice (DCN) sizes for multi-slice TPU pods or
multi-host GPU clusters; an axis's full size is its in-slice size times its DCN size, with
the DCN factor outermost.

Parameters are born sharded (`shard_model_init`: eval_shape -> shardings -> jit(init,
out_shardings)), and `check_not_replicated` fails a run whose big parameters stayed replicated
(a missing rule, or a mesh axis that divides nothing).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from kernels import ROW_AXES
from models.config import get_config
from models.transformer import Transformer

# An axis a mesh does not name has size 1. There is no context-parallel axis: a sequence is never
# split over devices ("length" maps to no mesh axis).
MESH_AXES = ("data", "fsdp", "expert", "tensor")

# logical axis -> mesh axes it may be sharded over (in order).
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ROW_AXES),  # the rows' mesh axes, as the kernels' shard_map splits them
    ("length", ()),
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
    ("layers", ()),  # the stacked layers of a scan (models/transformer.py): never sharded
)
# The parameters' logical axes, whose rules a run's config may change (config.mesh.rules, as
# MaxText's logical_axis_rules): "batch" follows the kernels' row axes, "length" is never split
# (no context parallelism) and "layers" is scanned over, so those three stay as above.
PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "index_heads", "mlp", "experts", "q_lora",
              "kv_lora", "kv", "norm")


def make_rules(overrides: Mapping[str, str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
  """DEFAULT_RULES with the parameter axes of `overrides` (logical axis -> comma-separated mesh
  axes, in order; "" replicates) replaced. ValueError naming config.mesh.rules.<axis> for a
  logical axis not in PARAM_AXES, an unknown mesh axis or one named twice."""
  rules = dict(DEFAULT_RULES)
  for name, value in overrides.items():
    field = f"config.mesh.rules.{name}={value!r}"
    if name not in PARAM_AXES:
      raise ValueError(f"{field}: not a parameter axis; they are {', '.join(PARAM_AXES)}")
    axes = tuple(a.strip() for a in value.split(",") if a.strip())
    unknown = sorted(set(axes) - set(MESH_AXES))
    if unknown or len(set(axes)) < len(axes):
      raise ValueError(f"{field}: must name distinct mesh axes of {', '.join(MESH_AXES)}")
    rules[name] = axes
  return tuple(rules.items())


def make_mesh(shape: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all) with axes in MESH_AXES order; one size may be -1."""
  unknown = sorted(set(shape) - set(MESH_AXES))
  if unknown:
    raise ValueError(f"mesh axes {unknown} unknown; allowed: {MESH_AXES}")
  devices = list(devices if devices is not None else jax.devices())
  sizes = _resolve_sizes(shape, len(devices), "mesh")
  return Mesh(np.array(devices).reshape(sizes), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_from_config(cfg: Mapping[str, Any], devices: Sequence[jax.Device] | None = None
                     ) -> Mesh:
  """A mesh from a config section: in-slice axis sizes, plus optional across-slice sizes.

  `cfg` maps axis names to in-slice (ICI) sizes, one of which may be -1 (whatever is left),
  and may hold `dcn`: a mapping of axis names to across-slice sizes, e.g.
  `{"fsdp": -1, "tensor": 4, "dcn": {"data": 2}}` on two 64-chip slices gives data=2 (over
  DCN), fsdp=32, tensor=4. Works with dicts and ml_collections ConfigDicts.

  With several TPU slices (devices carry distinct `slice_index`) the device grid comes from
  `mesh_utils.create_hybrid_device_mesh`; on multi-process GPU clusters processes are the
  DCN granules; on one slice of TPU `mesh_utils.create_device_mesh` follows the physical
  topology; elsewhere (CPU, one GPU host) devices are reshaped in order, the DCN factor of
  each axis outermost, exactly as the hybrid mesh lays out slices.
  """
  cfg = dict(cfg)
  dcn = dict(cfg.pop("dcn", None) or {})
  for name, table in (("mesh", cfg), ("mesh.dcn", dcn)):
    unknown = sorted(set(table) - set(MESH_AXES))
    if unknown:
      raise ValueError(f"{name} axes {unknown} unknown; allowed: {MESH_AXES}")
  devices = list(devices if devices is not None else jax.devices())
  dcn_sizes = [int(dcn.get(a, 1)) for a in MESH_AXES]
  if any(s < 1 for s in dcn_sizes):
    raise ValueError(f"mesh.dcn {dcn}: sizes must be >= 1")
  n_granules = math.prod(dcn_sizes)
  if len(devices) % n_granules:
    raise ValueError(f"mesh.dcn {dcn}: {len(devices)} devices do not split into "
                     f"{n_granules} slices")
  name = "mesh" if n_granules == 1 else f"mesh (per slice, {n_granules} slices)"
  ici_sizes = _resolve_sizes(cfg, len(devices) // n_granules, name)
  grid = _device_grid(devices, ici_sizes, dcn_sizes)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _resolve_sizes(shape: Mapping[str, int], n_devices: int, name: str) -> list[int]:
  sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f"{name} {dict(shape)}: at most one axis may be -1")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if n_devices % known:
      raise ValueError(f"{name} {dict(shape)}: {n_devices} devices are not divisible by {known}")
    sizes[sizes.index(-1)] = n_devices // known
  if math.prod(sizes) != n_devices:
    raise ValueError(f"{name} {dict(shape)} needs {math.prod(sizes)} devices, have {n_devices}")
  return sizes


def _device_grid(devices: list, ici: list[int], dcn: list[int]) -> np.ndarray:
  n_granules = math.prod(dcn)
  platform = devices[0].platform
  slices = {getattr(d, "slice_index", 0) for d in devices}
  processes = {d.process_index for d in devices}
  if n_granules > 1 and len(slices) == n_granules:
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                allow_split_physical_axes=True)
  if n_granules > 1 and platform == "gpu" and len(processes) == n_granules:
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
  if n_granules == 1 and platform == "tpu":
    return mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=True)
  # Plain order: granule g holds devices [g * per, (g + 1) * per); axis i of the grid is
  # (dcn_i outer, ici_i inner), the layout create_hybrid_device_mesh builds from slices.
  rank = len(ici)
  grid = np.array(devices, dtype=object).reshape(*dcn, *ici)
  grid = grid.transpose([j for i in range(rank) for j in (i, rank + i)])
  return grid.reshape([d * i for d, i in zip(dcn, ici)])


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


def shard_count(spec: PartitionSpec, mesh) -> int:
  """How many pieces `spec` cuts an array into on `mesh` (a Mesh, an AbstractMesh or anything
  with a `shape` mapping): the product of the sizes of the mesh axes it names."""
  sizes = dict(mesh.shape)
  return math.prod(sizes[axis] for entry in spec if entry is not None
                   for axis in (entry if isinstance(entry, tuple) else (entry,)))


def state_shardings(state: Any, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
  """NamedShardings for every Variable of an (abstract) nnx State, from its logical axes."""
  def one(var):
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    axes = var.get_metadata().get("logical_axes") if isinstance(var, nnx.Variable) else None
    if axes is None:
      axes = (None,) * len(value.shape)
    return NamedSharding(mesh, logical_to_spec(axes, value.shape, mesh, rules))
  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_shardings(opt_state: Any, params: Any, param_shardings: Any, mesh) -> Any:
  """Shardings for an optimiser state (arrays or abstract): subtrees shaped like `params`
  (Adam's moments) take `param_shardings`, everything else (step counts) is replicated."""
  params_def = jax.tree.structure(params)
  replicated = NamedSharding(mesh, PartitionSpec())

  def is_param_tree(x) -> bool:
    return jax.tree.structure(x) == params_def

  def one(sub):
    if is_param_tree(sub):
      return param_shardings
    return jax.tree.map(lambda _: replicated, sub)
  return jax.tree.map(one, opt_state, is_leaf=is_param_tree)


def logical_sharding(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                     rules=DEFAULT_RULES) -> NamedSharding:
  """The NamedSharding of an array (e.g. an activation or a batch field) with logical axes."""
  return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def put_global(x, sharding: NamedSharding) -> jax.Array:
  """A host array (the same value in every process) as a global array of `sharding`: each
  process places only its own devices' slices (works on one process and on several)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def to_host(x: Any) -> Any:
  """A jax.Array's value as numpy in every process (gathered across processes when it spans
  devices of other processes); any other value as it is."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return x


def _path_name(path) -> str:
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)


def check_not_replicated(state: Any, shardings: Any, min_bytes: int = 1 << 20) -> None:
  """Fails (ValueError naming the parameter paths) when any array of at least `min_bytes`
  would be fully replicated on a mesh of more than one device.

  `state` holds arrays, jax.ShapeDtypeStructs or nnx Variables of them; `shardings` is the
  matching pytree of NamedShardings (e.g. from `state_shardings`).
  """
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)
  sharding_leaves = treedef.flatten_up_to(shardings)
  offenders = []
  mesh_size = 1
  for (path, leaf), sharding in zip(leaves, sharding_leaves):
    value = leaf.get_value() if is_var(leaf) else leaf
    mesh_size = max(mesh_size, len(sharding.device_set))
    nbytes = math.prod(value.shape) * np.dtype(value.dtype).itemsize
    if nbytes >= min_bytes and sharding.is_fully_replicated and len(sharding.device_set) > 1:
      offenders.append(f"{_path_name(path)} {tuple(value.shape)} ({nbytes / 2**20:.2f} MiB)")
  if offenders:
    raise ValueError(
        f"{len(offenders)} parameter(s) of >= {min_bytes} bytes are fully replicated on a "
        f"{mesh_size}-device mesh (add a logical-axis rule, or pick mesh sizes that divide "
        "them): " + "; ".join(offenders))


def shard_model_init(cfg: Any, mesh: Mesh, rules=DEFAULT_RULES, seed: int = 0) -> nnx.Module:
  """Builds `models.transformer.Transformer(cfg)` with every variable created directly in
  its target sharding (no full copy on one device): nnx.eval_shape for shapes and logical
  axes -> `state_shardings` -> jax.jit(init, out_shardings=...). `cfg` is a ModelConfig or a
  preset name. Values equal `models.transformer.build(cfg, seed=seed)` up to float rounding
  (the jitted normal sampler may differ from the eager one in the last bit)."""
  if isinstance(cfg, str):
    cfg = get_config(cfg)

  def create():
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))

  graphdef, abstract_state = nnx.split(nnx.eval_shape(create))
  shardings = state_shardings(abstract_state, mesh, rules)
  state = jax.jit(lambda: nnx.split(create())[1], out_shardings=shardings)()
  return nnx.merge(graphdef, state)
