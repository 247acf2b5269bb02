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
"""

from __future__ import annotations

import jax

from kernels import autotune, indexer, reference, sparse_mla_gpu, sparse_mla_tpu

BACKENDS = ("auto", "reference", "interpret", "gpu", "tpu")


def _power_of_two_16(n: int) -> bool:
  return n >= 16 and n & (n - 1) == 0


def _resolve(backend: str, gpu_ok: bool, what: str) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"kernel backend {backend!r}: must be one of {BACKENDS}")
  if backend == "auto":
    platform = jax.default_backend()
    if platform == "gpu":
      return "gpu" if gpu_ok else "reference"
    return "tpu" if platform == "tpu" else "reference"
  if backend == "gpu" and not gpu_ok:
    raise ValueError(f"kernel backend 'gpu': {what} must be powers of two >= 16 for the "
                     "Triton tiles (use 'reference' or 'interpret' for these shapes)")
  return backend


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, scale: float, d_v: int,
               backend: str = "auto", block_config: str = "default"
               ) -> tuple[jax.Array, jax.Array]:
  """Sparse MLA attention (contract in kernels.reference.sparse_mla and spec/dsa.md):
  q [B,S,H,D], kv [B,L,D], indices [B,S,K] int32 (-1 = skip) -> (out [B,S,H,d_v],
  lse [B,S,H] fp32); differentiable in q and kv. `block_config="auto"`: the Pallas kernels'
  launch parameters are autotuned per shape (kernels/autotune.py; no effect on the reference)."""
  autotune.check_block_config(block_config)
  gpu_ok = sparse_mla_gpu.gpu_supported(q.shape[-1], d_v)
  backend = _resolve(backend, gpu_ok, f"d_v={d_v} and the rope width {q.shape[-1] - d_v}")
  if backend == "reference":
    return reference.sparse_mla(q, kv, indices, scale=scale, d_v=d_v)
  if backend == "tpu":
    return sparse_mla_tpu.sparse_mla(q, kv, indices, scale=scale, d_v=d_v,
                                     block_config=block_config)
  return sparse_mla_gpu.sparse_mla(q, kv, indices, scale=scale, d_v=d_v,
                                   interpret=backend == "interpret", block_config=block_config)


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
  backend = _resolve(backend, gpu_ok, f"the indexer head width {q.shape[-1]}")
  if backend == "reference":
    return reference.lightning_indexer(q, k, w, topk=topk, causal=causal, q_offset=q_offset,
                                       segment_ids=segment_ids)
  return indexer.lightning_indexer(q, k, w, topk=topk, causal=causal, q_offset=q_offset,
                                   segment_ids=segment_ids,
                                   platform="tpu" if backend == "tpu" else "gpu",
                                   interpret=backend == "interpret", block_config=block_config)
