"""Sparse MLA attention as Pallas Mosaic-TPU kernels (run with `pltpu.InterpretParams()` on CPU).

Contract: `kernels.reference.sparse_mla` and docs/dsa.md. Same program decomposition as the
GPU kernel (one token x one block of query heads; the index list walked in chunks of
`block_k`; online softmax; index -1 skipped), with TPU means of gathering:

- The index lists are scalar-prefetched into SMEM (`PrefetchScalarGridSpec`), together with
  each token's count of chunks up to its last valid index. SMEM is small, so the wrapper
  cuts the query axis into calls of at most `_SMEM_INDICES` prefetched indices.
- The latent cache stays in HBM (`memory_space=pl.ANY`) as two arrays, kv[..., :d_v] and
  kv[..., d_v:] (the 512 + 64 split; each DMA'd row is lane-aligned), and every chunk's rows
  arrive by one DMA per row into a double-buffered VMEM tile: chunk c + 1 is in flight while
  chunk c is scored. A -1 slot fetches row 0 and is masked.
- TPU has no atomics, so the backward writes each token's per-slot dK/dV contributions
  ([K, D] fp32, summed over head blocks in VMEM) and XLA adds them into dKV with a
  scatter-add per query chunk: a deterministic segment-sum whose extra memory is bounded by
  the chunk (contributions of at most `_SMEM_INDICES` slots at a time).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import autotune
from kernels.vjp import Tiling, attention_with_vjp, launch_params

# int32 indices prefetched into SMEM per pallas_call (64 KiB).
_SMEM_INDICES = 16384


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
  """a @ b with fp32 accumulation."""
  # Explicit either way: a global jax_default_matmul_precision="highest" would otherwise ask
  # Mosaic for an fp32 contraction of bf16 operands, which v5e rejects ("Bad lhs type").
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
  return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


class _Gather:
  """Per-row DMAs of one chunk of a token's index list into VMEM slot `slot`."""

  def __init__(self, idx_ref, kv_nope_hbm, kv_rope_hbm, nope_buf, rope_buf, sems, *,
               batch_row, base, block_k):
    self.idx_ref, self.sems = idx_ref, sems
    self.kv_nope_hbm, self.kv_rope_hbm = kv_nope_hbm, kv_rope_hbm
    self.nope_buf, self.rope_buf = nope_buf, rope_buf
    self.batch_row, self.base, self.block_k = batch_row, base, block_k

  def _copies(self, chunk, j, slot):
    row = jnp.maximum(self.idx_ref[self.base + chunk * self.block_k + j], 0)
    return (pltpu.make_async_copy(self.kv_nope_hbm.at[self.batch_row, row],
                                  self.nope_buf.at[slot, j], self.sems.at[slot, 0]),
            pltpu.make_async_copy(self.kv_rope_hbm.at[self.batch_row, row],
                                  self.rope_buf.at[slot, j], self.sems.at[slot, 1]))

  def rows(self, slot) -> tuple[jax.Array, jax.Array]:
    """The chunk in slot `slot` as ([block_k, d_v], [block_k, d_rope]) values."""
    nope, rope = self.nope_buf[slot], self.rope_buf[slot]  # [block_k, 1, d]
    return nope.reshape(self.block_k, nope.shape[-1]), rope.reshape(self.block_k, rope.shape[-1])

  def start(self, chunk, slot):
    def one(j, carry):
      for copy in self._copies(chunk, j, slot):
        copy.start()
      return carry
    lax.fori_loop(0, self.block_k, one, 0)

  def wait(self, chunk, slot):
    def one(j, carry):
      for copy in self._copies(chunk, j, slot):
        copy.wait()
      return carry
    lax.fori_loop(0, self.block_k, one, 0)

  def valid(self, chunk) -> jax.Array:
    """[1, block_k] fp32: 1 where the chunk's slot holds an index, 0 at -1."""
    lanes = lax.broadcasted_iota(jnp.int32, (1, self.block_k), 1)

    def one(j, mask):
      ok = self.idx_ref[self.base + chunk * self.block_k + j] >= 0
      return jnp.where(lanes == j, ok.astype(jnp.float32), mask)
    return lax.fori_loop(0, self.block_k, one, jnp.zeros((1, self.block_k), jnp.float32))


def _chunk_loop(gather: _Gather, nchunks, body, init):
  """Runs body(chunk, slot, carry) over chunks [0, nchunks) with the next chunk's DMAs in
  flight while the current one is used."""
  @pl.when(nchunks > 0)
  def _():
    gather.start(0, 0)

  def step(chunk, carry):
    slot = chunk % 2

    @pl.when(chunk + 1 < nchunks)
    def _():
      gather.start(chunk + 1, 1 - slot)
    gather.wait(chunk, slot)
    return body(chunk, slot, carry)
  return lax.fori_loop(0, nchunks, step, init)


def _fwd_kernel(idx_ref, nchunks_ref, q_nope_ref, q_rope_ref, kv_nope_hbm, kv_rope_hbm,
                out_ref, lse_ref, nope_buf, rope_buf, sems, *, scale, block_k, steps, width):
  token = pl.program_id(0) * steps + pl.program_id(1)
  gather = _Gather(idx_ref, kv_nope_hbm, kv_rope_hbm, nope_buf, rope_buf, sems,
                   batch_row=pl.program_id(0), base=token * width, block_k=block_k)
  q_nope, q_rope = q_nope_ref[...], q_rope_ref[...]
  block_h, d_v = q_nope.shape

  def body(chunk, slot, carry):
    acc, row_max, row_sum = carry
    k_nope, k_rope = gather.rows(slot)
    logits = (_mm(q_nope, k_nope.T) + _mm(q_rope, k_rope.T)) * scale
    logits = jnp.where(gather.valid(chunk) > 0.0, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1, keepdims=True))
    shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = jnp.exp(row_max - shift)
    probs = jnp.exp(logits - shift)
    row_sum = row_sum * correction + jnp.sum(probs, axis=1, keepdims=True)
    acc = acc * correction + _mm(probs.astype(k_nope.dtype), k_nope)
    return acc, new_max, row_sum

  init = (jnp.zeros((block_h, d_v), jnp.float32), jnp.full((block_h, 1), -jnp.inf, jnp.float32),
          jnp.zeros((block_h, 1), jnp.float32))
  acc, row_max, row_sum = _chunk_loop(gather, nchunks_ref[token], body, init)
  seen = row_sum > 0.0
  safe_sum = jnp.where(seen, row_sum, 1.0)
  out_ref[...] = jnp.where(seen, acc / safe_sum, 0.0).astype(out_ref.dtype)
  lse_ref[...] = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)


def _bwd_kernel(idx_ref, nchunks_ref, q_nope_ref, q_rope_ref, dout_ref, lse_ref, delta_ref,
                kv_nope_hbm, kv_rope_hbm, dq_nope_ref, dq_rope_ref, dk_nope_ref, dk_rope_ref,
                nope_buf, rope_buf, sems, *, scale, block_k, steps, width):
  token = pl.program_id(0) * steps + pl.program_id(1)
  gather = _Gather(idx_ref, kv_nope_hbm, kv_rope_hbm, nope_buf, rope_buf, sems,
                   batch_row=pl.program_id(0), base=token * width, block_k=block_k)

  # The per-slot dK/dV block is shared by the token's head blocks (grid axis 2, sequential).
  @pl.when(pl.program_id(2) == 0)
  def _():
    dk_nope_ref[...] = jnp.zeros_like(dk_nope_ref)
    dk_rope_ref[...] = jnp.zeros_like(dk_rope_ref)

  q_nope, q_rope, dout = q_nope_ref[...], q_rope_ref[...], dout_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]  # [bh, 1] fp32

  def body(chunk, slot, carry):
    dq_nope, dq_rope = carry
    k_nope, k_rope = gather.rows(slot)
    logits = (_mm(q_nope, k_nope.T) + _mm(q_rope, k_rope.T)) * scale
    probs = jnp.where(gather.valid(chunk) > 0.0, jnp.exp(logits - lse), 0.0)
    dlogits = probs * (_mm(dout, k_nope.T) - delta) * scale
    dlogits_lo = dlogits.astype(k_nope.dtype)
    rows = pl.ds(pl.multiple_of(chunk * block_k, block_k), block_k)
    dk_nope_ref[rows, :] += (_mm(dlogits_lo.T, q_nope)
                             + _mm(probs.astype(dout.dtype).T, dout))
    dk_rope_ref[rows, :] += _mm(dlogits_lo.T, q_rope)
    return dq_nope + _mm(dlogits_lo, k_nope), dq_rope + _mm(dlogits_lo, k_rope)

  init = (jnp.zeros(dq_nope_ref.shape, jnp.float32), jnp.zeros(dq_rope_ref.shape, jnp.float32))
  dq_nope, dq_rope = _chunk_loop(gather, nchunks_ref[token], body, init)
  dq_nope_ref[...] = dq_nope
  dq_rope_ref[...] = dq_rope


@dataclasses.dataclass(frozen=True)
class _Tiling(Tiling):
  """Static parameters of one call on a TPU."""
  tokens_per_call: int
  interpret: Any  # False or a (frozen) pltpu.InterpretParams


def _scratch(t: _Tiling, d_rope: int, dtype):
  return [pltpu.VMEM((2, t.block_k, 1, t.d_v), dtype),
          pltpu.VMEM((2, t.block_k, 1, d_rope), dtype),
          pltpu.SemaphoreType.DMA((2, 2))]


def _call_prologue(indices: jax.Array, t: _Tiling):
  """Flattened SMEM index list and per-token chunk counts of one query chunk."""
  slots = jnp.arange(1, indices.shape[-1] + 1, dtype=jnp.int32)
  last = jnp.max(jnp.where(indices >= 0, slots, 0), axis=-1)
  nchunks = (last + t.block_k - 1) // t.block_k
  return indices.reshape(-1), nchunks.reshape(-1)


def _fwd_call(q_nope, q_rope, kv_nope, kv_rope, indices, t: _Tiling):
  batch, steps, heads, d_v = q_nope.shape
  d_rope, width = q_rope.shape[-1], indices.shape[-1]
  flat_idx, nchunks = _call_prologue(indices, t)
  kernel = functools.partial(_fwd_kernel, scale=t.scale, block_k=t.block_k, steps=steps,
                             width=width)

  def head_spec(d):
    return pl.BlockSpec((None, None, t.block_h, d), lambda b, s, h, *_: (b, s, h, 0))
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(batch, steps, heads // t.block_h),
          in_specs=[head_spec(d_v), head_spec(d_rope), pl.BlockSpec(memory_space=pl.ANY),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=[head_spec(d_v), head_spec(1)],
          scratch_shapes=_scratch(t, d_rope, kv_nope.dtype)),
      out_shape=[jax.ShapeDtypeStruct((batch, steps, heads, d_v), q_nope.dtype),
                 jax.ShapeDtypeStruct((batch, steps, heads, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel")),
      interpret=t.interpret,
      name="sparse_mla_fwd_tpu",
  )(flat_idx, nchunks, q_nope, q_rope, kv_nope, kv_rope)


def _bwd_call(q_nope, q_rope, dout, lse, delta, kv_nope, kv_rope, indices, t: _Tiling):
  batch, steps, heads, d_v = q_nope.shape
  d_rope, width = q_rope.shape[-1], indices.shape[-1]
  flat_idx, nchunks = _call_prologue(indices, t)
  kernel = functools.partial(_bwd_kernel, scale=t.scale, block_k=t.block_k, steps=steps,
                             width=width)

  def head_spec(d):
    return pl.BlockSpec((None, None, t.block_h, d), lambda b, s, h, *_: (b, s, h, 0))

  def slot_spec(d):
    return pl.BlockSpec((None, None, width, d), lambda b, s, h, *_: (b, s, 0, 0))
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2, grid=(batch, steps, heads // t.block_h),
          in_specs=[head_spec(d_v), head_spec(d_rope), head_spec(d_v), head_spec(1),
                    head_spec(1), pl.BlockSpec(memory_space=pl.ANY),
                    pl.BlockSpec(memory_space=pl.ANY)],
          out_specs=[head_spec(d_v), head_spec(d_rope), slot_spec(d_v), slot_spec(d_rope)],
          scratch_shapes=_scratch(t, d_rope, kv_nope.dtype)),
      out_shape=[jax.ShapeDtypeStruct((batch, steps, heads, d_v), jnp.float32),
                 jax.ShapeDtypeStruct((batch, steps, heads, d_rope), jnp.float32),
                 jax.ShapeDtypeStruct((batch, steps, width, d_v), jnp.float32),
                 jax.ShapeDtypeStruct((batch, steps, width, d_rope), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=t.interpret,
      name="sparse_mla_bwd_tpu",
  )(flat_idx, nchunks, q_nope, q_rope, dout, lse, delta, kv_nope, kv_rope)


def _by_query_chunk(x: jax.Array, tokens: int) -> jax.Array:
  """[B, S, ...] -> [S / tokens, B, tokens, ...] (S already padded)."""
  batch, steps = x.shape[:2]
  return jnp.moveaxis(x.reshape(batch, steps // tokens, tokens, *x.shape[2:]), 1, 0)


def _from_query_chunks(x: jax.Array) -> jax.Array:
  n, batch, tokens = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(batch, n * tokens, *x.shape[3:])


def _forward(q, kv, indices, t: _Tiling):
  kv_nope, kv_rope = kv[..., None, :t.d_v], kv[..., None, t.d_v:]

  def one(xs):
    q_c, idx_c = xs
    return _fwd_call(q_c[..., :t.d_v], q_c[..., t.d_v:], kv_nope, kv_rope, idx_c, t)
  out, lse = lax.map(one, (_by_query_chunk(q, t.tokens_per_call),
                           _by_query_chunk(indices, t.tokens_per_call)))
  return _from_query_chunks(out), _from_query_chunks(lse)[..., 0]


def _backward(q, kv, indices, out, lse, dout, dlse, t: _Tiling):
  batch, length, dim = kv.shape
  kv_nope, kv_rope = kv[..., None, :t.d_v], kv[..., None, t.d_v:]
  finite = jnp.isfinite(lse)
  lse_safe = jnp.where(finite, lse, 0.0)[..., None]
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  delta = (delta - jnp.where(finite, dlse, 0.0))[..., None]
  batch_rows = jnp.arange(batch)[:, None, None]

  def one(dkv, xs):
    q_c, do_c, lse_c, delta_c, idx_c = xs
    dq_nope, dq_rope, dk_nope, dk_rope = _bwd_call(
        q_c[..., :t.d_v], q_c[..., t.d_v:], do_c, lse_c, delta_c, kv_nope, kv_rope, idx_c, t)
    rows = jnp.where(idx_c >= 0, idx_c, length)  # out of range: dropped by the scatter
    dkv = dkv.at[batch_rows, rows].add(jnp.concatenate([dk_nope, dk_rope], axis=-1),
                                       mode="drop")
    return dkv, jnp.concatenate([dq_nope, dq_rope], axis=-1)

  chunks = tuple(_by_query_chunk(x, t.tokens_per_call)
                 for x in (q, dout.astype(q.dtype), lse_safe, delta, indices))
  dkv, dq = lax.scan(one, jnp.zeros((batch, length, dim), jnp.float32), chunks)
  return _from_query_chunks(dq), dkv


_attend = attention_with_vjp(_forward, _backward)


def default_block_h(heads: int) -> int:
  """Heads per program: the head count rounded up to a multiple of 8 (sublanes), at most 64."""
  return min(64, -(-heads // 8) * 8)


def tuning_candidates(heads: int, topk: int) -> list[dict]:
  """What `block_config="auto"` times: heads per program (multiples of 8 up to the default)
  and rows per DMA'd chunk (32 up to 128, not past the index list)."""
  block_hs = sorted({h for h in (8, 16, 32, 64) if h < default_block_h(heads)}
                    | {default_block_h(heads)})
  block_ks = [k for k in (32, 64, 128) if k <= max(32, pl.next_power_of_2(topk))]
  return [dict(block_h=h, block_k=k) for h in block_hs for k in block_ks]


def tuned_launch(q: jax.Array, kv: jax.Array, indices: jax.Array, *, scale: float, d_v: int,
                 interpret) -> dict:
  """block_h and block_k for these shapes from the autotune cache (kernels/autotune.py)."""
  return autotune.tune_sparse_mla("sparse_mla_tpu", sparse_mla,
                                  tuning_candidates(q.shape[2], indices.shape[-1]), q, kv,
                                  indices, scale=scale, d_v=d_v, interpret=interpret)


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, scale: float, d_v: int,
               interpret=False, block_h: int | None = None, block_k: int = 64,
               block_config: str = "default") -> tuple[jax.Array, jax.Array]:
  """Sparse MLA on TPU (contract of `kernels.reference.sparse_mla`), differentiable in q, kv.

  Args:
    q: [B, S, H, D]; kv: [B, L, D]; indices: [B, S, K] int32 (-1 = skip).
    scale, d_v: softmax scale and value width.
    interpret: False on a TPU; `pltpu.InterpretParams()` to run on CPU.
    block_h: heads per program (default min(64, H rounded up to 8)); block_k: rows per chunk.
    block_config: "default" uses block_h and block_k; "auto" the autotuned choice for these
      shapes (`tuned_launch`).

  Returns:
    what `kernels.reference.sparse_mla` returns, out in q's dtype and lse in fp32.
  """
  batch, steps, heads, _ = q.shape
  launch = launch_params(
      q, kv, d_v, block_config,
      lambda: tuned_launch(q, kv, indices, scale=scale, d_v=d_v, interpret=interpret),
      block_h=block_h, block_k=block_k)
  block_h, block_k = launch["block_h"], launch["block_k"]
  dtype = jnp.promote_types(q.dtype, kv.dtype)
  block_h = block_h or default_block_h(heads)
  width = -(-indices.shape[-1] // block_k) * block_k
  tokens = max(1, min(steps, _SMEM_INDICES // (batch * width)))
  tiling = _Tiling(scale=float(scale), d_v=d_v, block_h=block_h, block_k=block_k,
                   tokens_per_call=tokens, interpret=interpret)
  padded_steps = -(-steps // tokens) * tokens
  pad_heads = -heads % block_h
  q_padded = jnp.pad(q.astype(dtype), ((0, 0), (0, padded_steps - steps), (0, pad_heads),
                                       (0, 0)))
  idx = jnp.pad(indices.astype(jnp.int32),
                ((0, 0), (0, padded_steps - steps), (0, width - indices.shape[-1])),
                constant_values=-1)
  out, lse = _attend(q_padded, kv.astype(dtype), idx, tiling)
  return out[:, :steps, :heads].astype(q.dtype), lse[:, :steps, :heads]
