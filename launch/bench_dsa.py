"""DSA kernel benchmark: sparse MLA and the lightning indexer against dense MLA attention, for
prefill and decode at 8K, 32K, 64K and 128K context (docs/dsa.md, performance anchors).

  python launch/bench_dsa.py --backend=gpu --json=/tmp/bench_dsa.json      # on a GPU
  python launch/bench_dsa.py --backend=tpu                                 # on a TPU
  python launch/bench_dsa.py --smoke --backend=interpret                   # CPU: plumbing only
  python launch/bench_dsa.py --backend=gpu --autotune                      # tuned launch params

Shapes follow DeepSeek-V3.2 (128 heads, 576 = 512 + 64 latent, top-k 2048, indexer 64 x 128):
- prefill: the last `prefill_tokens` queries of a context-long sequence (FlashMLA's s_q 4096),
  each with top-k random causal indices (the kernel's speed depends on the count, not on which
  rows the indexer picked);
- decode: `decode_batch` sequences, one new token each, against a context-long cache.

Reported per row: time (median of --iters after a compile run), achieved TFLOP/s with FLOPs
counted as FlashMLA does, 2 * sum(valid indices) * heads * (576 + 512), against the ~800 bf16
ceiling; achieved TB/s counting what the kernel must move at least (each token's gathered rows
once, queries, outputs, index lists), against ~3.0; and the speed-up over dense attention
(XLA einsum + softmax over every causal key, chunked over queries so its logits fit; its
FLOPs count only causal keys). `indexer` rows time the lightning indexer alone and
`sparse+indexer` the two together. Numbers from a CPU run (--smoke) say nothing about GPUs.
With --autotune the kernels run with `block_config="auto"`: each shape's launch parameters
are timed once on first use (kernels/autotune.py, before the timed runs) and read back from
the cache ($SEEDRL_AUTOTUNE_CACHE or ~/.cache/seedrl/autotune.json) afterwards.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kernels  # noqa: E402
from kernels import autotune  # noqa: E402

_BACKEND = flags.DEFINE_enum("backend", "auto", list(kernels.BACKENDS), "Kernel backend.")
_CONTEXTS = flags.DEFINE_list("contexts", ["8192", "32768", "65536", "131072"],
                              "Context lengths.")
_HEADS = flags.DEFINE_integer("heads", 128, "Query heads.")
_TOPK = flags.DEFINE_integer("topk", 2048, "Indices per query token.")
_INDEX_HEADS = flags.DEFINE_integer("index_heads", 64, "Indexer heads.")
_INDEX_DIM = flags.DEFINE_integer("index_dim", 128, "Indexer head width.")
_PREFILL_TOKENS = flags.DEFINE_integer("prefill_tokens", 4096, "Query tokens per prefill.")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 128, "Sequences per decode step.")
_D_V = flags.DEFINE_integer("d_v", 512, "Latent (value) width.")
_D_ROPE = flags.DEFINE_integer("d_rope", 64, "Rope width of the latent.")
_ITERS = flags.DEFINE_integer("iters", 10, "Timed runs after one compile run.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes (CPU plumbing check).")
_JSON = flags.DEFINE_string("json", "", "Write the results here as JSON.")
_AUTOTUNE = flags.DEFINE_bool("autotune", False, "Autotuned kernel launch parameters "
                              "(block_config='auto') instead of the defaults.")
_SCALE = 0.13523  # DeepSeek-V3 softmax scale with YaRN mscale (docs/dsa.md)
_PEAK_TFLOPS, _PEAK_TBPS = 800.0, 3.0  # measured H100 ceilings (docs/dsa.md)


def timed(fn, *args, iters: int | None = None) -> float:
  """Median seconds of fn(*args) over `iters` (default --iters) runs after a compile run."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(_ITERS.value if iters is None else iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def causal_indices(key, positions: jax.Array, topk: int) -> jax.Array:
  """[B, S, K] random indices <= each query's position; -1 beyond position + 1 picks."""
  batch, steps = positions.shape
  idx = jax.random.randint(key, (batch, steps, topk), 0, jnp.iinfo(jnp.int32).max)
  idx = idx % (positions[..., None] + 1)
  return jnp.where(jnp.arange(topk) <= positions[..., None], idx, -1).astype(jnp.int32)


def dense_attention(q, kv, positions, *, d_v: int, chunk: int):
  """Dense absorbed MLA over every key <= each query's position, chunked over queries:
  q [B,S,H,D], kv [B,L,D], positions [B,S] -> [B,S,H,d_v]."""
  batch, steps, heads, dim = q.shape
  n = steps // chunk

  def one(c):
    q_c = jax.lax.dynamic_slice_in_dim(q, c * chunk, chunk, axis=1)
    pos = jax.lax.dynamic_slice_in_dim(positions, c * chunk, chunk, axis=1)
    logits = jnp.einsum("bthd,bld->bhtl", q_c, kv, preferred_element_type=jnp.float32) * _SCALE
    allowed = jnp.arange(kv.shape[1])[None, None, None, :] <= pos[:, None, :, None]
    probs = jax.nn.softmax(jnp.where(allowed, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhtl,bld->bthd", probs.astype(kv.dtype), kv[..., :d_v])
  out = jax.lax.map(one, jnp.arange(n))  # [n, B, chunk, H, d_v]
  return jnp.moveaxis(out, 0, 1).reshape(batch, steps, heads, d_v)


def row(phase, context, name, seconds, flop, nbytes, dense_seconds=None):
  result = {"phase": phase, "context": context, "kernel": name, "ms": seconds * 1e3,
            "tflops": flop / seconds / 1e12, "tbps": nbytes / seconds / 1e12,
            "tflops_of_peak": flop / seconds / 1e12 / _PEAK_TFLOPS,
            "tbps_of_peak": nbytes / seconds / 1e12 / _PEAK_TBPS}
  if dense_seconds is not None:
    result["speedup_vs_dense"] = dense_seconds / seconds
  return result


def bench_phase(phase: str, context: int, key) -> list[dict]:
  heads, topk, d_v, dim = _HEADS.value, _TOPK.value, _D_V.value, _D_V.value + _D_ROPE.value
  backend, dtype = _BACKEND.value, jnp.bfloat16
  block_config = "auto" if _AUTOTUNE.value else "default"
  if phase == "prefill":
    batch, steps = 1, min(_PREFILL_TOKENS.value, context)
    positions = jnp.broadcast_to(jnp.arange(context - steps, context), (1, steps))
  else:
    batch, steps = _DECODE_BATCH.value, 1
    positions = jnp.full((batch, 1), context - 1)
  keys = jax.random.split(key, 6)
  q = jax.random.normal(keys[0], (batch, steps, heads, dim), dtype)
  kv = jax.random.normal(keys[1], (batch, context, dim), dtype)
  indices = causal_indices(keys[2], positions, topk)
  valid = float(jnp.sum(indices >= 0))
  itemsize = jnp.dtype(dtype).itemsize
  io_bytes = batch * steps * heads * (dim + d_v) * itemsize + indices.size * 4
  sparse_flop = 2.0 * valid * heads * (dim + d_v)
  sparse_bytes = valid * dim * itemsize + io_bytes

  causal_keys = float(jnp.sum(positions + 1))
  dense_flop = 2.0 * causal_keys * heads * (dim + d_v)
  dense_bytes = batch * context * dim * itemsize + io_bytes - indices.size * 4
  chunk = max(1, min(steps, (1 << 30) // (4 * batch * heads * context)))
  while steps % chunk:
    chunk -= 1
  dense = jax.jit(lambda q, kv: dense_attention(q, kv, positions, d_v=d_v, chunk=chunk))
  sparse = jax.jit(lambda q, kv, idx: kernels.sparse_mla(q, kv, idx, scale=_SCALE, d_v=d_v,
                                                         backend=backend,
                                                         block_config=block_config)[0])
  q_i = jax.random.normal(keys[3], (batch, steps, _INDEX_HEADS.value, _INDEX_DIM.value), dtype)
  k_i = jax.random.normal(keys[4], (batch, context, _INDEX_DIM.value), dtype)
  w_i = jax.random.normal(keys[5], (batch, steps, _INDEX_HEADS.value), jnp.float32)
  offset = positions[:, 0]
  index = jax.jit(lambda q, k, w: kernels.lightning_indexer(q, k, w, topk=topk,
                                                            q_offset=offset, backend=backend,
                                                            block_config=block_config))
  index_flop = 2.0 * causal_keys * _INDEX_HEADS.value * _INDEX_DIM.value
  index_bytes = (batch * context * _INDEX_DIM.value + q_i.size) * itemsize + indices.size * 8

  t_dense = timed(dense, q, kv)
  t_sparse = timed(sparse, q, kv, indices)
  t_index = timed(index, q_i, k_i, w_i)
  return [row(phase, context, "dense", t_dense, dense_flop, dense_bytes, t_dense),
          row(phase, context, "sparse_mla", t_sparse, sparse_flop, sparse_bytes, t_dense),
          row(phase, context, "indexer", t_index, index_flop, index_bytes),
          row(phase, context, "sparse+indexer", t_sparse + t_index, sparse_flop + index_flop,
              sparse_bytes + index_bytes, t_dense)]


def print_table(rows: list[dict]) -> None:
  header = (f"{'phase':8} {'context':>8} {'kernel':15} {'ms':>10} {'TFLOP/s':>8} {'%peak':>6} "
            f"{'TB/s':>7} {'%peak':>6} {'vs dense':>8}")
  print(header)
  print("-" * len(header))
  for r in rows:
    speedup = f"{r['speedup_vs_dense']:7.2f}x" if "speedup_vs_dense" in r else ""
    print(f"{r['phase']:8} {r['context']:>8} {r['kernel']:15} {r['ms']:10.3f} "
          f"{r['tflops']:8.2f} {100 * r['tflops_of_peak']:5.1f}% {r['tbps']:7.3f} "
          f"{100 * r['tbps_of_peak']:5.1f}% {speedup:>8}")


def main(argv) -> None:
  del argv
  if _SMOKE.value:
    flags.FLAGS.contexts = ["256", "512"]
    flags.FLAGS.heads, flags.FLAGS.topk, flags.FLAGS.prefill_tokens = 16, 64, 64
    flags.FLAGS.decode_batch, flags.FLAGS.index_heads, flags.FLAGS.index_dim = 4, 4, 32
    flags.FLAGS.d_v, flags.FLAGS.d_rope, flags.FLAGS.iters = 64, 16, 2
  contexts = [int(c) for c in _CONTEXTS.value]
  key = jax.random.key(0)
  rows = []
  for context in contexts:
    for phase in ("prefill", "decode"):
      key, sub = jax.random.split(key)
      rows.extend(bench_phase(phase, context, sub))
  print_table(rows)
  if _JSON.value:
    meta = {"device": str(jax.devices()[0].device_kind), "platform": jax.default_backend(),
            "backend": _BACKEND.value, "heads": _HEADS.value, "topk": _TOPK.value,
            "block_config": "auto" if _AUTOTUNE.value else "default",
            "autotune_cache": autotune.cache_path() if _AUTOTUNE.value else "",
            "latent": [_D_V.value, _D_ROPE.value], "prefill_tokens": _PREFILL_TOKENS.value,
            "decode_batch": _DECODE_BATCH.value, "dtype": "bfloat16",
            "flops": f"2 * sum(valid indices) * heads * ({_D_V.value + _D_ROPE.value} + "
                     f"{_D_V.value}); dense: causal keys only",
            "bytes": "gathered rows once per token + q + out + indices (dense: whole cache)",
            "peaks": {"tflops": _PEAK_TFLOPS, "tbps": _PEAK_TBPS}}
    with open(_JSON.value, "w") as f:
      json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {_JSON.value}")


if __name__ == "__main__":
  app.run(main)
