"""MoE expert parallelism: experts sharded over the "expert" mesh axis, tokens exchanged by
all-to-all, grouped matmuls (ragged_dot) on each device's own experts.

`expert_parallel_experts(x, expert_ids, weights, w_gate, w_up, w_down, mesh=...)` has the
signature of `models.ops.ragged_experts` plus the mesh, and the same result (dropless). Inside
`jax.shard_map`, on each device:

  1. its tokens' k assignments are sorted by expert id; since device p owns the contiguous
     experts [p * E_local, (p + 1) * E_local), this also groups them by destination device;
  2. per-expert counts are all-gathered, so every device knows how many rows each source
     sends to each of its experts (and where they land);
  3. the rows travel to their experts' devices, either by `ragged_all_to_all` (exact sizes;
     GPU/TPU) or by a padded `all_to_all` with a slot of capacity N_local * k per
     destination, i.e. every local assignment could go to one device, so nothing is ever
     dropped (XLA:CPU, which has no ragged all-to-all);
  4. the received rows are sorted by local expert and go through SwiGLU with three
     `ragged_dot`s (the expert FFN's hidden dimension may be sharded over "tensor": the
     down projection's partial sums are then psum'd);
  5. the outputs travel back the same way, are scaled by the gate weights and scatter-added
     onto their tokens.

Both exchange paths run the same per-row maths (only the buffer layouts differ) and agree
to fp32 rounding with `ragged_experts` / `dense_experts`.

Buffers. Dropless (capacity_factor 0), the receive buffer and the expert FFN's rows hold the
worst case (every source sends all its rows here): P * N_local * k rows, which the backward
pass keeps. With a capacity factor c > 0 (GShard, MaxText), each (source, destination) pair
carries at most C = ceil(c * N_local * k / P) rows (`pair_capacity`; c = 1 is the balanced
load), so the buffers hold P * C = ~c * N_local * k rows. A source's rows for one destination
are ordered by (expert id, token position, choice), and the rows past the first C of that
order are dropped: their expert output is zero, so the token keeps its residual (and its other
experts' outputs). `dropped_assignments` counts them, from the routing alone.

Tokens are sharded over every mesh axis of size > 1 except "tensor" (padded to a multiple
with zero-weight rows); expert weights are gathered over the non-expert axes on entry
(FSDP), so their gradients are summed over those axes on exit.

The model picks this path with `dispatch_for_mesh` when the ambient mesh
(`jax.set_mesh(mesh)` around the jitted call) has an expert axis > 1.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from models import ops

EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
IMPLS = ("auto", "ragged", "padded")


def pair_capacity(rows_per_shard: int, n_shards: int, capacity_factor: float) -> int:
  """Rows one source may send one destination: all of them (dropless) when capacity_factor is
  0, else ceil(capacity_factor * rows_per_shard / n_shards), at most rows_per_shard."""
  if capacity_factor < 0:
    raise ValueError(f"capacity_factor={capacity_factor}: must be >= 0 (0: dropless)")
  if not capacity_factor:
    return rows_per_shard
  return min(rows_per_shard, max(1, math.ceil(capacity_factor * rows_per_shard / n_shards)))


def _token_layout(mesh_shape: dict, n_tokens: int) -> tuple[tuple[str, ...], int, int]:
  """(the mesh axes tokens are split over, their shard count, the padding to a multiple)."""
  token_axes = tuple(a for a, s in mesh_shape.items() if s > 1 and a != TENSOR_AXIS)
  n_token_shards = math.prod(mesh_shape[a] for a in token_axes)
  return token_axes, n_token_shards, -n_tokens % n_token_shards


def dropped_assignments(expert_ids: jax.Array, n_experts: int, mesh, capacity_factor: float,
                        token_mask: jax.Array | None = None) -> jax.Array:
  """How many of the (token, expert) assignments `expert_parallel_experts` drops with this
  capacity factor on this mesh (0 when dropless): expert_ids [N, k] int, token_mask [N]
  (padding tokens' assignments are not counted). Mirrors the dispatch: tokens split in
  contiguous blocks over the token shards, each block's rows for a destination ordered by
  (expert id, position), the first pair_capacity kept."""
  shape = dict(mesh.shape)
  n_shards = shape.get(EXPERT_AXIS, 1)
  n, k = expert_ids.shape
  if not capacity_factor or n_shards <= 1:
    return jnp.zeros((), jnp.int32)
  _, n_token_shards, pad = _token_layout(shape, n)
  valid = jnp.ones((n,), bool) if token_mask is None else token_mask.reshape(-1).astype(bool)
  ids = jnp.pad(expert_ids.astype(jnp.int32), ((0, pad), (0, 0)),
                constant_values=n_experts - 1)  # as the dispatch pads
  valid = jnp.pad(valid, (0, pad))  # padding rows carry zero weight: never counted
  rows = (n + pad) // n_token_shards * k
  capacity = pair_capacity(rows, n_shards, capacity_factor)
  ids = ids.reshape(n_token_shards, rows)
  valid = jnp.repeat(valid.reshape(n_token_shards, -1), k, axis=1)
  dest = ids // (n_experts // n_shards)
  order = jnp.argsort(ids, axis=1, stable=True)
  dest_sorted = jnp.take_along_axis(dest, order, axis=1)
  valid_sorted = jnp.take_along_axis(valid, order, axis=1)
  # Rank of each row among its source's rows for its destination, in the dispatch's order.
  onehot = jax.nn.one_hot(dest_sorted, n_shards, dtype=jnp.int32)
  rank = jnp.sum((jnp.cumsum(onehot, axis=1) - onehot) * onehot, axis=-1)
  return jnp.sum((rank >= capacity) & valid_sorted).astype(jnp.int32)


def expert_axis_size(mesh) -> int:
  return dict(mesh.shape).get(EXPERT_AXIS, 1) if mesh is not None else 1


def ambient_mesh(mesh=None):
  """`mesh`, else the ambient mesh of `jax.set_mesh` when it has an expert axis > 1, else None."""
  mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty or expert_axis_size(mesh) <= 1:
    return None
  return mesh


def dispatch_for_mesh(local_fn: Callable, mesh=None, capacity_factor: float = 0.0) -> Callable:
  """`local_fn` (e.g. models.ops.ragged_experts), or the expert-parallel version of it (with
  that capacity factor; 0: dropless) when `mesh` (default: the ambient mesh of `jax.set_mesh`)
  has an expert axis > 1."""
  mesh = ambient_mesh(mesh)
  if mesh is None:
    return local_fn
  return functools.partial(expert_parallel_experts, mesh=mesh, capacity_factor=capacity_factor)


def expert_parallel_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array,
                            w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                            mesh: Mesh, impl: str = "auto",
                            capacity_factor: float = 0.0) -> jax.Array:
  """Expert-parallel dispatch: x [N, D], ids/weights [N, k], w_gate/w_up [E, D, F],
  w_down [E, F, D] -> [N, D]; experts sharded over the mesh's "expert" axis. Dropless with
  capacity_factor 0, else bounded as the module docstring says."""
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}: must be one of {IMPLS}")
  impl = ops.expert_exchange() if impl == "auto" else impl
  shape = dict(mesh.shape)
  n_shards = shape.get(EXPERT_AXIS, 1)
  n_experts = w_gate.shape[0]
  if n_experts % n_shards:
    raise ValueError(f"{n_experts} experts do not split over expert axis of size {n_shards}")
  n = x.shape[0]
  token_axes, n_token_shards, pad = _token_layout(shape, n)
  tensor = shape.get(TENSOR_AXIS, 1)
  tensor_axis = TENSOR_AXIS if tensor > 1 and w_gate.shape[-1] % tensor == 0 else None
  capacity = pair_capacity((n + pad) // n_token_shards * expert_ids.shape[1], n_shards,
                           capacity_factor)
  if pad:
    x = jnp.pad(x, ((0, pad), (0, 0)))
    # The last expert: padding rows sort last in the last destination's block, so under a
    # capacity they are the first rows dropped, never a real row's place.
    expert_ids = jnp.pad(expert_ids, ((0, pad), (0, 0)), constant_values=n_experts - 1)
    weights = jnp.pad(weights, ((0, pad), (0, 0)))  # zero gate weight: no effect, no grad

  rows = P(token_axes or None, None)
  local = functools.partial(_local_experts, n_experts=n_experts, n_shards=n_shards,
                            impl=impl, tensor_axis=tensor_axis, capacity=capacity)
  y = jax.shard_map(
      local, mesh=mesh,
      in_specs=(rows, rows, rows, P(EXPERT_AXIS, None, tensor_axis),
                P(EXPERT_AXIS, None, tensor_axis), P(EXPERT_AXIS, tensor_axis, None)),
      out_specs=rows, check_vma=True)(x, expert_ids.astype(jnp.int32), weights,
                                      w_gate, w_up, w_down)
  return y[:n]


def _exclusive_cumsum(x: jax.Array, axis: int = 0) -> jax.Array:
  return jnp.cumsum(x, axis=axis) - x


def _kept_counts(counts: jax.Array, kept: jax.Array) -> jax.Array:
  """Per-expert counts [..., E_local] of a block sorted by expert whose first `kept` [...] rows
  survive the capacity cut."""
  ends = jnp.minimum(jnp.cumsum(counts, axis=-1), kept[..., None])
  return jnp.diff(ends, axis=-1, prepend=0)


def _local_experts(x, expert_ids, weights, w_gate, w_up, w_down, *, n_experts, n_shards,
                   impl, tensor_axis, capacity):
  """One device: x [n, D], ids/weights [n, k], w_* [E_local, D, F_local] / [E_local, F_local, D];
  each (source, destination) pair carries at most `capacity` rows (n * k: dropless)."""
  n, k = expert_ids.shape
  e_local = n_experts // n_shards
  flat_ids = expert_ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  token_of = order // k
  sorted_ids = flat_ids[order]
  xs = x[token_of]  # [n * k, D], grouped by expert, hence by destination device

  counts = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)  # [E] sent by me
  all_counts = jax.lax.all_gather(counts, EXPERT_AXIS)  # [P, E]: row q = sent by device q
  me = jax.lax.axis_index(EXPERT_AXIS)
  recv_counts = jax.lax.dynamic_slice_in_dim(all_counts, me * e_local, e_local, axis=1)
  sizes = all_counts.reshape(n_shards, n_shards, e_local).sum(-1)  # [src, dst] rows
  send_offsets = _exclusive_cumsum(sizes[me])  # where each destination's block starts in xs
  kept = jnp.minimum(sizes, capacity)  # [src, dst] rows that travel
  recv_counts = _kept_counts(recv_counts, kept[:, me])

  expert_fn = functools.partial(_expert_ffn, w_gate=w_gate, w_up=w_up, w_down=w_down,
                                tensor_axis=tensor_axis)
  if impl == "ragged":
    back = _exchange_ragged(xs, sizes, kept, send_offsets, recv_counts, me, capacity, expert_fn)
  else:
    dest = sorted_ids // e_local
    slot = jnp.arange(n * k) - send_offsets[dest]
    back = _exchange_padded(xs, dest, slot, recv_counts, n_shards, capacity, expert_fn)
  back = back * weights.reshape(-1)[order][:, None].astype(back.dtype)
  return jnp.zeros((n, x.shape[-1]), back.dtype).at[token_of].add(back)


def _segment_of(row: jax.Array, counts: jax.Array) -> jax.Array:
  """Index of the segment (of consecutive `counts`) holding each row; len(counts) if none."""
  return jnp.searchsorted(jnp.cumsum(counts), row, side="right")


def _exchange_padded(xs, dest, slot, recv_counts, n_shards, capacity, expert_fn):
  """all_to_all with `capacity` slots per (source, destination) pair; rows at slot >= capacity
  stay home and get zero back."""
  dim = xs.shape[-1]
  send = jnp.zeros((n_shards, capacity, dim), xs.dtype).at[dest, slot].set(xs, mode="drop")
  recv = jax.lax.all_to_all(send, EXPERT_AXIS, 0, 0)  # [src, capacity, D]
  e_local = recv_counts.shape[1]
  # Row j from source q belongs to the local expert whose segment of recv_counts[q] holds j.
  local_expert = jax.vmap(_segment_of, in_axes=(None, 0))(jnp.arange(capacity), recv_counts)
  out = expert_fn(recv.reshape(n_shards * capacity, dim),
                  local_expert.reshape(-1), e_local, recv_counts.sum(0))
  back = jax.lax.all_to_all(out.reshape(n_shards, capacity, dim), EXPERT_AXIS, 0, 0)
  return jnp.where((slot < capacity)[:, None], back[dest, jnp.minimum(slot, capacity - 1)], 0)


def _exchange_ragged(xs, sizes, kept, send_offsets, recv_counts, me, capacity, expert_fn):
  """ragged_all_to_all of the kept rows (`kept` [src, dst], at most `capacity` each) into a
  receive buffer of n_shards * capacity rows; dropped rows get zero back."""
  dim = xs.shape[-1]
  n_shards, e_local = recv_counts.shape
  # My rows for device p land after the rows that lower-ranked sources send to p.
  land_offsets = _exclusive_cumsum(kept, axis=0)[me]
  recv_sizes = kept[:, me]
  recv_offsets = _exclusive_cumsum(recv_sizes)
  buffer = jnp.zeros((n_shards * capacity, dim), xs.dtype)
  recv = jax.lax.ragged_all_to_all(xs, buffer, send_offsets, kept[me], land_offsets,
                                   recv_sizes, axis_name=EXPERT_AXIS)
  # Received rows are source-major, each source's block sorted by expert.
  segment = _segment_of(jnp.arange(n_shards * capacity), recv_counts.reshape(-1))
  local_expert = jnp.where(segment < n_shards * e_local, segment % e_local, e_local)
  out = expert_fn(recv, local_expert, e_local, recv_counts.sum(0))
  # Back to the sources, into the slots their rows left from (where each block started).
  return_offsets = _exclusive_cumsum(sizes, axis=1)[:, me]
  return jax.lax.ragged_all_to_all(out, jnp.zeros_like(xs), recv_offsets, recv_sizes,
                                   return_offsets, kept[me], axis_name=EXPERT_AXIS)


def _expert_ffn(rows, local_expert, e_local, group_sizes, *, w_gate, w_up, w_down,
                tensor_axis):
  """SwiGLU of each row through its local expert (rows with local_expert == e_local are
  padding: their output is zero)."""
  perm = jnp.argsort(local_expert, stable=True)
  xs = rows[perm]
  group_sizes = group_sizes.astype(jnp.int32)
  hidden = (jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes))
            * jax.lax.ragged_dot(xs, w_up, group_sizes))
  out = jax.lax.ragged_dot(hidden, w_down, group_sizes)
  if tensor_axis is not None:
    out = jax.lax.psum(out, tensor_axis)
  out = jnp.zeros_like(out).at[perm].set(out)
  return jnp.where((local_expert < e_local)[:, None], out, 0)
