"""Sparse MLA attention as Pallas kernels in the Triton style (GPU; `interpret=True` on CPU).

Contract: `kernels.reference.sparse_mla` and docs/dsa.md. Every query head attends to the same
latent rows kv[b, indices[b, t, :]] (MLA in MQA mode); V = the rows' first d_v columns.

Why the Triton lowering and not Mosaic GPU: the kernel's core is a gather of 64 arbitrary
latent rows per step. In Triton lowering, indexing a ref with an int vector is a real
per-thread gather (`kv_ref[rows, pl.ds(...)]`), and `plt.atomic_add` scatters the backward's
dKV; Mosaic GPU wants TMA (gather4 only on Blackwell) and warpgroup layouts for both, and
would need Hopper-only code.

Forward (`_fwd_kernel`): one program per (query token, block of `block_h` heads, split).
It walks the token's index list in chunks of `block_k`: gathers block_k x (d_v + rope) rows
as two power-of-two tiles (d_v = 512 and rope = 64 at full scale: Triton rejects a 576-wide
tile, interpret mode does not), scores them, and keeps an online softmax. Index -1 is masked
and whole chunks past a token's last valid index are not visited. With `num_splits` > 1 the
list is cut into contiguous partitions (flash-decoding: one new token per sequence gives too
few programs otherwise) and the partial results are merged by their log-sum-exp in jnp.

Backward (`_bwd_kernel`, custom_vjp): one program per (token, head block) recomputes P from
the saved lse, writes dQ once (deterministic), and adds each chunk's dK/dV rows into an fp32
[B, L + 1, D] accumulator with atomics. Atomics rather than a segment-sum: a segment-sum
needs every token's per-slot contributions materialised, S * K * D floats (150 GB at 32K
tokens, top-k 2048, D 576); atomics need only the accumulator. The cost is fp32
non-associativity on GPU (run-to-run bits may differ; interpret mode is sequential). Before
the kernel each token's list is sorted and de-duplicated (a repeated row gets its multiplicity
as a weight; P is identical for repeats of the same row), so no atomic sees the same row
twice: interpret mode emulates an atomic as read-add-write, which would drop duplicates.
Skipped (-1) and de-duplicated slots add their (zero) contribution to the spare row L.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from kernels import autotune
from kernels.vjp import Tiling, attention_with_vjp, launch_params

# Enough programs to fill an H100 (132 SMs) about twice before splitting the index lists.
_TARGET_PROGRAMS = 264

# A Triton program must fit a Hopper SM's shared memory: at most 227 KiB per block on an H100
# or H200 (the first H200 run failed "out of resources" on both passes at 64 heads x 64 rows).
# Shared memory of the lowered kernels at DeepSeek-V3.2's width (d_v 512 + rope 64), compiled
# for sm_90 by triton 3.6 (8 warps, 2 stages; 2026-11-28, on the CPU host):
#   forward   bf16 64 heads x 64 rows 216 KiB;  fp32 64 x 64 305 KiB, 32 x 32 148 KiB;
#   backward  bf16 64 x 64 409 KiB, 32 x 32 136 KiB;  fp32 32 x 32 216 KiB, 16 x 32 148 KiB.
# The largest (heads, rows) tile each pass takes by default, per operand byte width; the
# backward never takes a larger one than its forward.
_FORWARD_TILE = {2: (64, 64), 4: (32, 32)}
_BACKWARD_TILE = {2: (32, 32), 4: (16, 32)}


def _tile(table: dict, dtype) -> tuple[int, int]:
  return table.get(jnp.dtype(dtype).itemsize, table[4])


def _dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False):
  """a @ b (optionally transposed operands) with fp32 accumulation; fp32 inputs in IEEE fp32
  (Triton would otherwise use TF32)."""
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  # Explicit either way: a global jax_default_matmul_precision="highest" would otherwise ask
  # Mosaic for an fp32 contraction of bf16 operands, which v5e rejects ("Bad lhs type").
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _gather_chunk(kv_ref, idx_ref, chunk: jax.Array, *, block_k: int, d_v: int, d_rope: int):
  """Rows of one chunk of the index list: (indices [bk], valid [bk], nope [bk, d_v],
  rope [bk, d_rope]); a -1 slot reads row 0 and is masked by the caller."""
  idx = idx_ref[pl.ds(chunk * block_k, block_k)]
  valid = idx >= 0
  rows = jnp.where(valid, idx, 0)
  return idx, valid, kv_ref[rows, pl.ds(0, d_v)], kv_ref[rows, pl.ds(d_v, d_rope)]


def _fwd_kernel(nchunks_ref, idx_ref, q_ref, kv_ref, out_ref, lse_ref, *, scale: float,
                d_v: int, d_rope: int, block_k: int, chunks_per_split: int):
  """One (token, head block, split): online softmax over its share of the index list."""
  split = pl.program_id(3)
  q_nope = q_ref[:, pl.ds(0, d_v)]  # [bh, d_v]
  q_rope = q_ref[:, pl.ds(d_v, d_rope)]  # [bh, d_rope]
  block_h = q_nope.shape[0]
  first = split * chunks_per_split
  last = jnp.minimum(first + chunks_per_split, nchunks_ref[0])

  def body(chunk, carry):
    acc, row_max, row_sum = carry
    _, valid, k_nope, k_rope = _gather_chunk(kv_ref, idx_ref, chunk, block_k=block_k, d_v=d_v,
                                             d_rope=d_rope)
    logits = (_dot(q_nope, k_nope, trans_b=True) + _dot(q_rope, k_rope, trans_b=True)) * scale
    logits = jnp.where(valid[None, :], logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    # A row that has seen only -1 slots keeps max -inf: shift by 0 so exp gives 0, not NaN.
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = jnp.exp(row_max - shift)
    probs = jnp.exp(logits - shift[:, None])
    row_sum = row_sum * correction + jnp.sum(probs, axis=1)
    acc = acc * correction[:, None] + _dot(probs.astype(k_nope.dtype), k_nope)
    return acc, new_max, row_sum

  init = (jnp.zeros((block_h, d_v), jnp.float32), jnp.full((block_h,), -jnp.inf, jnp.float32),
          jnp.zeros((block_h,), jnp.float32))
  acc, row_max, row_sum = lax.fori_loop(first, last, body, init)
  seen = row_sum > 0.0
  safe_sum = jnp.where(seen, row_sum, 1.0)
  out_ref[...] = jnp.where(seen[:, None], acc / safe_sum[:, None], 0.0).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)


def _bwd_kernel(nchunks_ref, idx_ref, mult_ref, q_ref, kv_ref, dout_ref, lse_ref, delta_ref,
                dkv_in_ref, dq_ref, dkv_ref, *, scale: float, d_v: int, d_rope: int,
                block_k: int, spare_row: int):
  """One (token, head block): dQ into its own block, dK/dV rows atomically into dkv_ref."""
  del dkv_in_ref  # the zero-initialised accumulator, aliased to dkv_ref
  q_nope = q_ref[:, pl.ds(0, d_v)]
  q_rope = q_ref[:, pl.ds(d_v, d_rope)]
  dout = dout_ref[...]  # [bh, d_v]
  lse = lse_ref[...]  # [bh] fp32, 0 where the token has no valid index (then P = 0)
  delta = delta_ref[...]  # [bh] fp32: rowsum(dO * O) - dlse
  block_h = q_nope.shape[0]
  cols_nope = jnp.broadcast_to(jnp.arange(d_v, dtype=jnp.int32)[None, :], (block_k, d_v))
  cols_rope = jnp.broadcast_to(jnp.arange(d_v, d_v + d_rope, dtype=jnp.int32)[None, :],
                               (block_k, d_rope))

  def body(chunk, carry):
    dq_nope, dq_rope = carry
    idx, valid, k_nope, k_rope = _gather_chunk(kv_ref, idx_ref, chunk, block_k=block_k,
                                               d_v=d_v, d_rope=d_rope)
    mult = mult_ref[pl.ds(chunk * block_k, block_k)].astype(jnp.float32)  # [bk]
    logits = (_dot(q_nope, k_nope, trans_b=True) + _dot(q_rope, k_rope, trans_b=True)) * scale
    probs = jnp.where(valid[None, :], jnp.exp(logits - lse[:, None]), 0.0) * mult[None, :]
    dprobs = _dot(dout, k_nope, trans_b=True)  # [bh, bk]
    dlogits = probs * (dprobs - delta[:, None]) * scale
    dlogits_lo = dlogits.astype(k_nope.dtype)
    dq_nope = dq_nope + _dot(dlogits_lo, k_nope)
    dq_rope = dq_rope + _dot(dlogits_lo, k_rope)
    dk_nope = _dot(dlogits_lo, q_nope, trans_a=True) + _dot(probs.astype(dout.dtype), dout,
                                                            trans_a=True)  # [bk, d_v]
    dk_rope = _dot(dlogits_lo, q_rope, trans_a=True)  # [bk, d_rope]
    target = jnp.where(valid, idx, spare_row)
    plt.atomic_add(dkv_ref, (jnp.broadcast_to(target[:, None], (block_k, d_v)), cols_nope),
                   dk_nope)
    plt.atomic_add(dkv_ref, (jnp.broadcast_to(target[:, None], (block_k, d_rope)), cols_rope),
                   dk_rope)
    return dq_nope, dq_rope

  init = (jnp.zeros((block_h, d_v), jnp.float32), jnp.zeros((block_h, d_rope), jnp.float32))
  dq_nope, dq_rope = lax.fori_loop(0, nchunks_ref[0], body, init)
  dq_ref[:, pl.ds(0, d_v)] = dq_nope
  dq_ref[:, pl.ds(d_v, d_rope)] = dq_rope


@dataclasses.dataclass(frozen=True)
class _Tiling(Tiling):
  """Static launch parameters of one call on a GPU."""
  num_splits: int
  interpret: bool
  num_warps: int
  num_stages: int

  def compiler_params(self):
    return plt.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _chunk_counts(indices: jax.Array, block_k: int) -> jax.Array:
  """[B, S, 1] int32: chunks up to and including each token's last valid index."""
  slots = jnp.arange(1, indices.shape[-1] + 1, dtype=jnp.int32)
  last = jnp.max(jnp.where(indices >= 0, slots, 0), axis=-1)
  return ((last + block_k - 1) // block_k)[..., None]


def _pad_axis(x: jax.Array, axis: int, multiple: int, value) -> jax.Array:
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _forward(q, kv, indices, t: _Tiling):
  """Padded inputs in, (out [B,S,Hp,d_v] q.dtype, lse [B,S,Hp] fp32) out."""
  batch, steps, heads, dim = q.shape
  length = kv.shape[1]
  d_rope = dim - t.d_v
  nchunks = _chunk_counts(indices, t.block_k)
  total_chunks = indices.shape[-1] // t.block_k
  splits = max(1, min(t.num_splits, total_chunks))
  per_split = -(-total_chunks // splits)
  out_dtype = q.dtype if splits == 1 else jnp.float32
  kernel = functools.partial(_fwd_kernel, scale=t.scale, d_v=t.d_v, d_rope=d_rope,
                             block_k=t.block_k, chunks_per_split=per_split)
  out, lse = pl.pallas_call(
      kernel,
      grid=(batch, steps, heads // t.block_h, splits),
      in_specs=[
          pl.BlockSpec((None, None, 1), lambda b, s, h, p: (b, s, 0)),
          pl.BlockSpec((None, None, indices.shape[-1]), lambda b, s, h, p: (b, s, 0)),
          pl.BlockSpec((None, None, t.block_h, dim), lambda b, s, h, p: (b, s, h, 0)),
          pl.BlockSpec((None, length, dim), lambda b, s, h, p: (b, 0, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, t.block_h, t.d_v), lambda b, s, h, p: (p, b, s, h, 0)),
          pl.BlockSpec((None, None, None, t.block_h), lambda b, s, h, p: (p, b, s, h)),
      ],
      out_shape=[jax.ShapeDtypeStruct((splits, batch, steps, heads, t.d_v), out_dtype),
                 jax.ShapeDtypeStruct((splits, batch, steps, heads), jnp.float32)],
      compiler_params=t.compiler_params(),
      interpret=t.interpret,
      name="sparse_mla_fwd",
  )(nchunks, indices, q, kv)
  if splits == 1:
    return out[0], lse[0]
  total = jax.nn.logsumexp(lse, axis=0)
  weights = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - jnp.where(jnp.isneginf(total), 0.0,
                                                                        total)))
  merged = jnp.sum(weights[..., None] * out, axis=0)
  return merged.astype(q.dtype), total


def dedupe_indices(indices: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Sorts each token's list (valid indices first, ascending) and keeps one slot per distinct
  row: returns (indices with repeats and skips as -1, multiplicity per slot (0 at -1))."""
  big = jnp.iinfo(jnp.int32).max
  keys = jnp.sort(jnp.where(indices >= 0, indices, big), axis=-1)
  slots = jnp.arange(keys.shape[-1], dtype=jnp.int32)
  new_run = jnp.concatenate([jnp.ones_like(keys[..., :1], bool),
                             keys[..., 1:] != keys[..., :-1]], axis=-1)
  run_end = jnp.concatenate([keys[..., 1:] != keys[..., :-1],
                             jnp.ones_like(keys[..., :1], bool)], axis=-1)
  start = lax.cummax(jnp.where(new_run, slots, 0), axis=keys.ndim - 1)
  end = lax.cummin(jnp.where(run_end, slots, keys.shape[-1]), axis=keys.ndim - 1, reverse=True)
  keep = new_run & (keys != big)
  mult = jnp.where(keep, end - start + 1, 0).astype(jnp.int32)
  return jnp.where(keep, keys, -1).astype(jnp.int32), mult


def _backward(q, kv, indices, out, lse, dout, dlse, t: _Tiling):
  """Padded inputs in, (dq fp32 [B,S,Hp,D], dkv fp32 [B,L,D]) out."""
  batch, steps, heads, dim = q.shape
  length = kv.shape[1]
  d_rope = dim - t.d_v
  most_h, most_k = _tile(_BACKWARD_TILE, q.dtype)
  t = dataclasses.replace(t, block_h=min(t.block_h, most_h), block_k=min(t.block_k, most_k))
  indices = _pad_axis(indices, 2, t.block_k, -1)
  unique, mult = dedupe_indices(indices)
  nchunks = _chunk_counts(unique, t.block_k)
  finite = jnp.isfinite(lse)
  lse_safe = jnp.where(finite, lse, 0.0)
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = delta - jnp.where(finite, dlse, 0.0)
  kernel = functools.partial(_bwd_kernel, scale=t.scale, d_v=t.d_v, d_rope=d_rope,
                             block_k=t.block_k, spare_row=length)
  row_spec = pl.BlockSpec((None, None, indices.shape[-1]), lambda b, s, h: (b, s, 0))
  head_spec = pl.BlockSpec((None, None, t.block_h), lambda b, s, h: (b, s, h))
  dkv_spec = pl.BlockSpec((None, length + 1, dim), lambda b, s, h: (b, 0, 0))
  dq, dkv = pl.pallas_call(
      kernel,
      grid=(batch, steps, heads // t.block_h),
      in_specs=[
          pl.BlockSpec((None, None, 1), lambda b, s, h: (b, s, 0)),
          row_spec, row_spec,
          pl.BlockSpec((None, None, t.block_h, dim), lambda b, s, h: (b, s, h, 0)),
          pl.BlockSpec((None, length, dim), lambda b, s, h: (b, 0, 0)),
          pl.BlockSpec((None, None, t.block_h, t.d_v), lambda b, s, h: (b, s, h, 0)),
          head_spec, head_spec, dkv_spec,
      ],
      out_specs=[pl.BlockSpec((None, None, t.block_h, dim), lambda b, s, h: (b, s, h, 0)),
                 dkv_spec],
      out_shape=[jax.ShapeDtypeStruct((batch, steps, heads, dim), jnp.float32),
                 jax.ShapeDtypeStruct((batch, length + 1, dim), jnp.float32)],
      input_output_aliases={8: 1},
      compiler_params=t.compiler_params(),
      interpret=t.interpret,
      name="sparse_mla_bwd",
  )(nchunks, unique, mult, q, kv, dout.astype(q.dtype), lse_safe, delta,
    jnp.zeros((batch, length + 1, dim), jnp.float32))
  return dq, dkv[:, :length]


_attend = attention_with_vjp(_forward, _backward)


def default_block_h(heads: int, dtype=jnp.bfloat16) -> int:
  """64 heads per program at scale in bf16 (32 in fp32: `_FORWARD_TILE`); fewer heads pad up
  to a power of two >= 16 (the smallest M of a Triton dot)."""
  return min(_tile(_FORWARD_TILE, dtype)[0], max(16, pl.next_power_of_2(heads)))


def default_num_splits(batch: int, steps: int, heads: int, topk: int, *, block_h: int,
                       block_k: int) -> int:
  """Index-list partitions per token: 1 when (token, head block) programs already fill the
  GPU (prefill), more for decode so that about `_TARGET_PROGRAMS` programs run."""
  programs = batch * steps * (-(-heads // block_h))
  chunks = max(1, -(-topk // block_k))
  return max(1, min(chunks, _TARGET_PROGRAMS // max(programs, 1)))


def gpu_supported(dim: int, d_v: int, block_k: int = 64) -> bool:
  """Triton tiles must be powers of two of at least 16: d_v, the rope part and block_k."""
  d_rope = dim - d_v

  def ok(n):
    return n >= 16 and n == pl.next_power_of_2(n)
  return ok(d_v) and ok(d_rope) and ok(block_k)


def tuning_candidates(heads: int, topk: int) -> list[dict]:
  """What `block_config="auto"` times: heads per program (16 up to the default), index-list
  chunk (32 up to 128, not past the list), Triton warps and pipeline stages."""
  block_hs = [h for h in (16, 32, 64) if h <= default_block_h(heads)]
  block_ks = [k for k in (32, 64, 128) if k <= max(32, pl.next_power_of_2(topk))]
  return [dict(block_h=h, block_k=k, num_warps=w, num_stages=s)
          for h in block_hs for k in block_ks for w in (4, 8) for s in (1, 2, 3)]


def tuned_launch(q: jax.Array, kv: jax.Array, indices: jax.Array, *, scale: float, d_v: int,
                 interpret: bool) -> dict:
  """Launch parameters for these shapes from the autotune cache (kernels/autotune.py); the
  forward pass is timed and they serve the backward pass too."""
  return autotune.tune_sparse_mla("sparse_mla_gpu", sparse_mla,
                                  tuning_candidates(q.shape[2], indices.shape[-1]), q, kv,
                                  indices, scale=scale, d_v=d_v, interpret=interpret)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, scale: float, d_v: int,
               interpret: bool = False, block_h: int | None = None, block_k: int | None = None,
               num_splits: int | None = None, num_warps: int = 8, num_stages: int = 2,
               block_config: str = "default") -> tuple[jax.Array, jax.Array]:
  """Sparse MLA (contract of `kernels.reference.sparse_mla`), differentiable in q and kv.

  Args:
    q: [B, S, H, D] queries; kv: [B, L, D] latent rows; indices: [B, S, K] int32 (-1 = skip).
    scale, d_v: softmax scale and value width (V = kv[..., :d_v]; D - d_v is the rope part).
    interpret: run the Pallas kernels in interpret mode (CPU tests).
    block_h: heads per program (default `default_block_h`); heads are zero-padded to it.
    block_k: index-list chunk per step (rows gathered at once; default 64 in bf16, 32 in
      fp32). The backward pass takes at most 32 heads x 32 rows (16 x 32 in fp32), which
      fit a Hopper SM's shared memory (`_BACKWARD_TILE`).
    num_splits: index-list partitions per token in the forward (default
      `default_num_splits`: 1 for prefill, more for decode).
    num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
    block_config: "default" uses the parameters above; "auto" replaces block_h, block_k,
      num_warps and num_stages by the autotuned choice for these shapes (`tuned_launch`).

  Returns:
    (out, lse) as `kernels.reference.sparse_mla`: out in q's dtype, lse fp32.
  """
  batch, steps, heads, _ = q.shape
  launch = launch_params(
      q, kv, d_v, block_config,
      lambda: tuned_launch(q, kv, indices, scale=scale, d_v=d_v, interpret=interpret),
      block_h=block_h, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
  block_h, block_k = launch["block_h"], launch["block_k"]
  num_warps, num_stages = launch["num_warps"], launch["num_stages"]
  dtype = jnp.promote_types(q.dtype, kv.dtype)
  block_h = block_h or default_block_h(heads, dtype)
  block_k = block_k or _tile(_FORWARD_TILE, dtype)[1]
  if num_splits is None:
    num_splits = default_num_splits(batch, steps, heads, indices.shape[-1], block_h=block_h,
                                    block_k=block_k)
  tiling = _Tiling(scale=float(scale), d_v=d_v, block_h=block_h, block_k=block_k,
                   num_splits=num_splits, interpret=bool(interpret), num_warps=num_warps,
                   num_stages=num_stages)
  q_padded = _pad_axis(q.astype(dtype), 2, block_h, 0)
  indices = _pad_axis(indices.astype(jnp.int32), 2, block_k, -1)
  out, lse = _attend(q_padded, kv.astype(dtype), indices, tiling)
  return out[:, :, :heads].astype(q.dtype), lse[:, :, :heads]

