"""Kernels for DeepSeek Sparse Attention behind one dispatch point.

`backend` is one of:
- "reference": the pure-jnp references (kernels/reference.py), the numerical ground truth;
- "interpret": the GPU-design Pallas kernels (kernels/sparse_mla_gpu.py, kernels/indexer.py)
  run with `interpret=True`: what the CPU tests exercise;
- "gpu": the same kernels lowered through Pallas' Triton backend; shapes the Triton tiles
  cannot take (widths not powers of two >= 16) raise ValueError;
- "tpu": the Mosaic-TPU kernels (kernels/sparse_mla_tpu.py; the indexer kernel with its
  offsets scalar-prefetched);
- "auto": the compiled kernels on a GPU (reference for shapes they cannot take) or a TPU, the
  reference on CPU.

Pallas kernels cannot be partitioned by XLA ("Mosaic kernels cannot be automatically
partitioned"), so under a multi-device ambient mesh (`jax.set_mesh`) every kernel backend runs
inside `jax.shard_map`: rows over the batch axes ("data", "fsdp", "expert"; replicated when the
batch does not divide), sparse-MLA query heads over "tensor" (when the head count divides).
Keys and the index list stay whole per row. The reference is left to XLA's partitioner.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels import autotune, indexer, reference, sparse_mla_gpu, sparse_mla_tpu

BACKENDS = ("auto", "reference", "interpret", "gpu", "tpu")
ROW_AXES = ("data", "fsdp", "expert")  # the mesh axes a batch's rows split over
HEAD_AXIS = "tensor"
DECODE_INDEXER_MIN_QUERIES = 16  # fewer queries per row: "auto" runs the indexer's reference


_target_platform: str | None = None


@contextlib.contextmanager
def target_platform(platform: str | None):
  """Resolve "auto" as on `platform` ("cpu", "gpu", "tpu") while tracing inside this block:
  how a CPU host compiles a program for a TPU topology ahead of time (launch/aot.py)."""
  global _target_platform
  previous, _target_platform = _target_platform, platform
  try:
    yield
  finally:
    _target_platform = previous


def platform() -> str:
  """The platform programs traced now run on: `target_platform`'s, else jax's default backend
  ("cpu", "gpu", "tpu")."""
  return _target_platform or jax.default_backend()


def _power_of_two_16(n: int) -> bool:
  return n >= 16 and n & (n - 1) == 0


def _resolve(backend: str, gpu_ok: bool, what: str) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"kernel backend {backend!r}: must be one of {BACKENDS}")
  if backend == "auto":
    target = platform()
    if target in ("gpu", "cuda", "rocm"):
      return "gpu" if gpu_ok else "reference"
    return "tpu" if target == "tpu" else "reference"
  if backend == "gpu" and not gpu_ok:
    raise ValueError(f"kernel backend 'gpu': {what} must be powers of two >= 16 for the "
                     "Triton tiles (use 'reference' or 'interpret' for these shapes)")
  return backend


def _ambient_mesh():
  """The multi-device mesh of `jax.set_mesh`, or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh is None or mesh.empty or mesh.size == 1 else mesh


def _row_and_head_axes(mesh, batch: int, heads: int | None) -> tuple:
  """Mesh axes for the batch dimension (None when it does not divide) and for heads."""
  shape = dict(mesh.shape)
  rows = tuple(a for a in ROW_AXES if shape.get(a, 1) > 1)
  if not rows or batch % math.prod(shape[a] for a in rows):
    rows = None
  tensor = shape.get(HEAD_AXIS, 1)
  head = HEAD_AXIS if heads is not None and tensor > 1 and heads % tensor == 0 else None
  return rows, head


def constrain_rows(x: jax.Array) -> jax.Array:
  """`x` with its leading (batch) dimension split over the ambient mesh's row axes and the
  others left to XLA; unchanged without a multi-device mesh or when the rows do not divide.
  The model pins each layer's activations with it, so every device computes its own rows of a
  micro-batch instead of all of them."""
  mesh = _ambient_mesh()
  if mesh is None:
    return x
  rows, _ = _row_and_head_axes(mesh, x.shape[0], None)
  if rows is None:
    return x
  spec = P(rows, *([P.UNCONSTRAINED] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, spec)  # under the mesh of jax.set_mesh


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, scale: float, d_v: int,
               backend: str = "auto", block_config: str = "default"
               ) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA attention (contract in kernels.reference.sparse_mla and docs/dsa.md):
  q [B,S,H,D], kv [B,L,D], indices [B,S,K] int32 (-1 = skip) -> (out [B,S,H,d_v],
  lse [B,S,H] fp32); differentiable in q and kv. `block_config="auto"`: the Pallas kernels'
  launch parameters are autotuned per shape (kernels/autotune.py; no effect on the reference)."""
  autotune.check_block_config(block_config)
  gpu_ok = sparse_mla_gpu.gpu_supported(q.shape[-1], d_v)
  backend = _resolve(backend, gpu_ok, f"d_v={d_v} and the rope width {q.shape[-1] - d_v}")
  if backend == "reference":
    return reference.sparse_mla(q, kv, indices, scale=scale, d_v=d_v)

  def call(q, kv, indices):
    if backend == "tpu":
      return sparse_mla_tpu.sparse_mla(q, kv, indices, scale=scale, d_v=d_v,
                                       block_config=block_config)
    return sparse_mla_gpu.sparse_mla(q, kv, indices, scale=scale, d_v=d_v,
                                     interpret=backend == "interpret", block_config=block_config)
  mesh = _ambient_mesh()
  if mesh is None:
    return call(q, kv, indices)
  rows, head = _row_and_head_axes(mesh, q.shape[0], q.shape[2])
  return jax.shard_map(
      call, mesh=mesh,
      in_specs=(P(rows, None, head, None), P(rows, None, None), P(rows, None, None)),
      out_specs=(P(rows, None, head, None), P(rows, None, head)), check_vma=False)(
          q, kv, indices)


def lightning_indexer(q: jax.Array, k: jax.Array, w: jax.Array, *, topk: int,
                      causal: bool = True, q_offset=0, segment_ids=None,
                      backend: str = "auto", block_config: str = "default"
                      ) -> tuple[jax.Array, jax.Array]:
  """Lightning-indexer top-k (contract in kernels.reference.lightning_indexer):
  q [B,S,HI,DI], k [B,L,DI], w [B,S,HI] -> (indices [B,S,K] int32 with -1 where fewer than K
  keys are selectable, scores [B,S,K] fp32). `segment_ids` [B,S] (packed sequences, L == S):
  a query selects keys of its own segment only. `block_config` as for `sparse_mla`."""
  autotune.check_block_config(block_config)
  gpu_ok = _power_of_two_16(q.shape[-1])
  if backend == "auto" and q.shape[1] < DECODE_INDEXER_MIN_QUERIES:
    # Fewer queries per row than the kernel's smallest query tile leave most of each tile's
    # GEMM idle: at DeepSeek-V3.2's decode shape (one query, 32K keys, 64 x 128 heads) the
    # Triton kernel took 7.47 ms and the reference 1.49 ms on an H200 (docs/gpu.md), so
    # "auto" takes the reference there on a GPU.
    gpu_ok = False
  backend = _resolve(backend, gpu_ok, f"the indexer head width {q.shape[-1]}")
  if backend == "reference":
    return reference.lightning_indexer(q, k, w, topk=topk, causal=causal, q_offset=q_offset,
                                       segment_ids=segment_ids)

  def call(q, k, w, q_offset, segment_ids):
    return indexer.lightning_indexer(q, k, w, topk=topk, causal=causal, q_offset=q_offset,
                                     segment_ids=segment_ids,
                                     platform="tpu" if backend == "tpu" else "gpu",
                                     interpret=backend == "interpret", block_config=block_config)
  mesh = _ambient_mesh()
  if mesh is None:
    return call(q, k, w, q_offset, segment_ids)
  # The score sums over indexer heads: heads stay whole; rows split over the batch axes.
  rows, _ = _row_and_head_axes(mesh, q.shape[0], None)
  q_offset = jnp.asarray(q_offset, jnp.int32)
  offset_spec = P(rows) if q_offset.ndim == 1 else P()
  row_specs = (P(rows, None, None, None), P(rows, None, None), P(rows, None, None), offset_spec,
               None if segment_ids is None else P(rows, None))
  return jax.shard_map(call, mesh=mesh, in_specs=row_specs,
                       out_specs=(P(rows, None, None), P(rows, None, None)),
                       check_vma=False)(q, k, w, q_offset, segment_ids)
