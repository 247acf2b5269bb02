"""Lightning-indexer scores as a Pallas kernel (GPU Triton, TPU Mosaic, or interpret mode), then
top-k in jnp, chunked over queries so the [queries, keys] score matrix never exists whole.

Contract: `kernels.reference.lightning_indexer` and docs/dsa.md:
  I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s])   (fp32), causal: s <= q_offset + t,
then top-k over s with -1 where fewer than K keys are selectable.

`_scores_kernel` computes one [block_q, block_l] tile of I: for each indexer head a GEMM of
the query tile against the key tile with the ReLU * w epilogue, summed over heads in fp32.
Tiles that lie wholly in the causal future run no GEMM. Queries are laid out head-major
([B, HI, S, DI]) so that each head's tile is one contiguous load on both GPU and TPU.

Top-k is a separate `lax.top_k` pass over each query chunk's scores (no top-k lowers inside a
TPU kernel, and a fused GPU top-k over 128K keys is its own project). lax.top_k breaks ties by
the lower index, as the reference does; the selected sets equal the reference's exactly when
the scores are bitwise equal (checked with exactly representable inputs in the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plt

from kernels import autotune, reference

# Score bytes held at once per query chunk (fp32 [B, chunk, L]).
_CHUNK_BYTES = 1 << 30


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b.T with fp32 accumulation (IEEE fp32 for fp32 inputs)."""
  # Explicit either way: a global jax_default_matmul_precision="highest" would otherwise ask
  # Mosaic for an fp32 contraction of bf16 operands, which v5e rejects ("Bad lhs type").
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def _scores_kernel(offset_ref, q_ref, k_ref, w_ref, out_ref, *, heads: int, length: int,
                   causal: bool):
  """One [block_q, block_l] tile of the indexer score for batch row program_id(0); its chunk's
  first query sits at position offset_ref[b]."""
  block_q, block_l = out_ref.shape
  q_block, l_block = pl.program_id(1), pl.program_id(2)
  first_query = offset_ref[pl.program_id(0)] + q_block * block_q
  query_pos = first_query + lax.broadcasted_iota(jnp.int32, (block_q, block_l), 0)
  key_pos = l_block * block_l + lax.broadcasted_iota(jnp.int32, (block_q, block_l), 1)
  allowed = key_pos < length
  live_heads = heads
  if causal:
    allowed = allowed & (key_pos <= query_pos)
    # No key of this tile is visible to any of its queries: skip the GEMMs.
    # (A product, not jnp.where(visible, heads, 0): jax 0.11's Triton lowering materialises
    # the select's integer literals as i1, and the loop below then fails to verify on a GPU.)
    visible = l_block * block_l <= first_query + block_q - 1
    live_heads = heads * visible.astype(jnp.int32)
  keys = k_ref[...]  # [bl, DI]

  def head(h, acc):
    logits = _dot_nt(q_ref[h], keys)  # [bq, bl]
    return acc + jnp.maximum(logits, 0.0) * w_ref[h]  # w_ref[h]: [bq, 1]

  acc = lax.fori_loop(0, live_heads, head, jnp.zeros((block_q, block_l), jnp.float32))
  out_ref[...] = jnp.where(allowed, acc, -jnp.inf)


def _chunk_scores(offset, q_hm, k, w_hm, *, length: int, causal: bool,
                  block_q: int, block_l: int, platform: str, interpret,
                  num_warps: int = 4, num_stages: int = 2) -> jax.Array:
  """fp32 scores [B, C, L_pad] of one query chunk (q_hm [B, HI, C, DI], w_hm [B, HI, C, 1])."""
  batch, heads, chunk, dim = q_hm.shape
  padded_len = k.shape[1]
  kernel = functools.partial(_scores_kernel, heads=heads, length=length, causal=causal)
  grid = (batch, chunk // block_q, padded_len // block_l)
  out_shape = jax.ShapeDtypeStruct((batch, chunk, padded_len), jnp.float32)

  # Index maps take `*_`: under PrefetchScalarGridSpec they also receive the offsets ref.
  in_specs = [pl.BlockSpec((None, heads, block_q, dim), lambda b, i, j, *_: (b, 0, i, 0)),
              pl.BlockSpec((None, block_l, dim), lambda b, i, j, *_: (b, j, 0)),
              pl.BlockSpec((None, heads, block_q, 1), lambda b, i, j, *_: (b, 0, i, 0))]
  out_spec = pl.BlockSpec((None, block_q, block_l), lambda b, i, j, *_: (b, i, j))

  if platform == "tpu":
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid,
                                               in_specs=in_specs, out_specs=out_spec),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        name="lightning_indexer_scores",
    )(offset, q_hm, k, w_hm)
  return pl.pallas_call(
      kernel,
      grid=grid,
      in_specs=[pl.BlockSpec((batch,), lambda b, i, j: (0,))] + in_specs,
      out_specs=out_spec,
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="lightning_indexer_scores",
  )(offset, q_hm, k, w_hm)


def default_block_q(steps: int) -> int:
  """Queries per tile: 64 at scale; a power of two >= 16 (the smallest M of a Triton dot)."""
  return min(64, max(16, pl.next_power_of_2(steps)))


def default_query_chunk(batch: int, steps: int, length: int, block_q: int) -> int:
  """Largest multiple of block_q whose fp32 score chunk fits `_CHUNK_BYTES`."""
  rows = max(1, _CHUNK_BYTES // (4 * batch * max(length, 1)))
  rows = max(block_q, rows // block_q * block_q)
  return min(rows, -(-steps // block_q) * block_q)


def tuning_candidates(steps: int, length: int, platform: str) -> list[dict]:
  """What `block_config="auto"` times: query tiles (16 up to 128, not past the queries), key
  tiles (64 up to 256, not past the keys) and, on GPU, Triton warps and pipeline stages."""
  block_qs = [b for b in (16, 32, 64, 128) if b <= max(16, pl.next_power_of_2(steps))]
  block_ls = [b for b in (64, 128, 256) if b <= max(64, pl.next_power_of_2(length))]
  tiles = [dict(block_q=q, block_l=bl) for q in block_qs for bl in block_ls]
  if platform == "tpu":
    return tiles
  return [dict(tile, num_warps=w, num_stages=s) for tile in tiles for w in (4, 8)
          for s in (1, 2, 3)]


def tuned_launch(q: jax.Array, k: jax.Array, w: jax.Array, *, topk: int, causal: bool,
                 platform: str, interpret) -> dict:
  """Tiles (and launch parameters) for these shapes from the autotune cache, timing every
  candidate on a miss (kernels/autotune.py). Timing places the queries at the end of the keys
  (q_offset = L - S: prefill when S == L, decode against a cache otherwise)."""
  steps, length = q.shape[1], k.shape[1]

  def make_inputs():
    rng = np.random.default_rng(0)
    return autotune.random_like(rng, q), autotune.random_like(rng, k), autotune.random_like(rng, w)

  def build(config):
    return jax.jit(functools.partial(lightning_indexer, topk=topk, causal=causal,
                                     q_offset=max(length - steps, 0), platform=platform,
                                     interpret=interpret, **config))
  return autotune.tune("lightning_indexer", {"q": q, "k": k, "w": w},
                       {"topk": topk, "causal": causal, "platform": platform,
                        "interpret": bool(interpret)},
                       tuning_candidates(steps, length, platform), make_inputs, build)


def lightning_indexer(q: jax.Array, k: jax.Array, w: jax.Array, *, topk: int,
                      causal: bool = True, q_offset: int | jax.Array = 0,
                      segment_ids: jax.Array | None = None, platform: str = "gpu",
                      interpret=False, block_q: int | None = None, block_l: int = 128,
                      query_chunk: int | None = None,
                      num_warps: int = 4, num_stages: int = 2, block_config: str = "default"
                      ) -> tuple[jax.Array, jax.Array]:
  """Top-k keys by the lightning-indexer score (contract of the reference).

  Args:
    q: [B, S, HI, DI] indexer queries; k: [B, L, DI] keys; w: [B, S, HI] folded head weights.
    topk: keys kept per query; the output width is min(topk, L).
    causal, q_offset: query t of row b sits at q_offset[b] + t and sees keys <= that.
    segment_ids: [B, S] packed sequences (L == S): a query sees keys of its segment only
      (applied to each chunk's scores before the top-k).
    platform: "gpu" (Triton launch parameters) or "tpu" (offsets scalar-prefetched).
    interpret: False, True (GPU-style interpret) or a `pltpu.InterpretParams` (TPU).
    block_q, block_l: score tile; query_chunk: queries scored per top-k pass (a multiple
      of block_q; default bounds the chunk's scores to 1 GiB).
    num_warps, num_stages: Triton launch parameters (GPU only).
    block_config: "default" uses the tile and launch parameters above; "auto" replaces
      block_q, block_l (and on GPU num_warps, num_stages) by the autotuned choice for these
      shapes (`tuned_launch`).

  Returns:
    indices [B, S, K] int32 (-1 where fewer than K keys are selectable) and scores [B, S, K]
    fp32 (-inf there). Not differentiable (the inputs are stop-gradient'ed): the selection
    passes no gradient, and the indexer's loss recomputes its scores in jnp
    (models/dsa.py).
  """
  q, k, w = (lax.stop_gradient(a) for a in (q, k, w))
  batch, steps, heads, dim = q.shape
  length = k.shape[1]
  kk = min(topk, length)
  autotune.check_block_config(block_config)
  if block_config == "auto":
    tuned = tuned_launch(q, k, w, topk=topk, causal=causal, platform=platform,
                         interpret=interpret)
    block_q, block_l = tuned["block_q"], tuned["block_l"]
    num_warps, num_stages = tuned.get("num_warps", num_warps), tuned.get("num_stages", num_stages)
  block_q = block_q or default_block_q(steps)
  chunk = query_chunk or default_query_chunk(batch, steps, length, block_q)
  if chunk % block_q:
    raise ValueError(f"query_chunk={chunk} must be a multiple of block_q={block_q}")
  n_chunks = -(-steps // chunk)
  padded_steps = n_chunks * chunk
  offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (batch,))
  dtype = jnp.promote_types(q.dtype, k.dtype)
  q_hm = jnp.pad(q.astype(dtype), ((0, 0), (0, padded_steps - steps), (0, 0), (0, 0)))
  q_hm = q_hm.transpose(0, 2, 1, 3)  # [B, HI, S_pad, DI]
  w_hm = jnp.pad(w.astype(jnp.float32), ((0, 0), (0, padded_steps - steps), (0, 0)))
  w_hm = w_hm.transpose(0, 2, 1)[..., None]  # [B, HI, S_pad, 1]
  keys = jnp.pad(k.astype(dtype), ((0, 0), (0, -length % block_l), (0, 0)))

  if segment_ids is not None:
    if segment_ids.shape != (batch, length) or length != steps:
      raise ValueError(f"segment_ids {segment_ids.shape} need queries and keys to be the same "
                       f"{(batch, steps)} tokens (packed training sequences), keys: {length}")
    padded_segments = jnp.pad(segment_ids, ((0, 0), (0, padded_steps - steps)),
                              constant_values=-1)

  def one_chunk(c: jax.Array):
    q_c = lax.dynamic_slice_in_dim(q_hm, c * chunk, chunk, axis=2)
    w_c = lax.dynamic_slice_in_dim(w_hm, c * chunk, chunk, axis=2)
    scores = _chunk_scores(offset + c * chunk, q_c, keys, w_c, length=length, causal=causal,
                           block_q=block_q, block_l=block_l, platform=platform,
                           interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    scores = scores[..., :length]
    if segment_ids is not None:
      query_segments = lax.dynamic_slice_in_dim(padded_segments, c * chunk, chunk, axis=1)
      scores = jnp.where(reference.same_segment(query_segments, segment_ids), scores, -jnp.inf)
    top_scores, top_idx = lax.top_k(scores, kk)
    return jnp.where(jnp.isneginf(top_scores), -1, top_idx).astype(jnp.int32), top_scores

  # lax.map runs the chunks one after another: one chunk's [B, C, L] scores live at a time.
  indices, top_scores = lax.map(one_chunk, jnp.arange(n_chunks, dtype=jnp.int32))

  def unchunk(x):  # [n, B, C, K] -> [B, S, K]
    return x.transpose(1, 0, 2, 3).reshape(batch, padded_steps, kk)[:, :steps]
  return unchunk(indices), unchunk(top_scores)
