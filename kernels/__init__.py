"""Kernels for DeepSeek Sparse Attention behind one dispatch point.

`backend` is one of "auto", "reference", "interpret", "gpu", "tpu". Only the pure-jnp
reference exists so far; "auto" resolves to it on every platform until compiled kernels land,
and asking for a compiled backend explicitly is an error that says so.
"""

from __future__ import annotations

import jax

from kernels import reference

BACKENDS = ("auto", "reference", "interpret", "gpu", "tpu")
_AVAILABLE = ("reference",)


def _resolve(backend: str) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"kernel backend {backend!r}: must be one of {BACKENDS}")
  if backend == "auto":
    return "reference"
  if backend not in _AVAILABLE:
    raise ValueError(f"kernel backend {backend!r} is not built yet; available: {_AVAILABLE}")
  return backend


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, scale: float, d_v: int,
               backend: str = "auto") -> tuple[jax.Array, jax.Array]:
  """Sparse MLA attention (contract in kernels.reference.sparse_mla and spec/dsa.md)."""
  _resolve(backend)
  return reference.sparse_mla(q, kv, indices, scale=scale, d_v=d_v)


def lightning_indexer(q: jax.Array, k: jax.Array, w: jax.Array, *, topk: int,
                      causal: bool = True, q_offset=0, backend: str = "auto"
                      ) -> tuple[jax.Array, jax.Array]:
  """Lightning-indexer top-k (contract in kernels.reference.lightning_indexer)."""
  _resolve(backend)
  return reference.lightning_indexer(q, k, w, topk=topk, causal=causal, q_offset=q_offset)
