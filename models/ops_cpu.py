"""The CPU bodies of `models.ops`: the same functions as the portable bodies there, shaped for
XLA:CPU's GEMM, fusion and scatter choices. Each was measured against the portable body on this
project's CPU hosts (figures beside each; docs/performance.md has the runs). They sum in another
order or round at another point, so results agree with the portable bodies to rounding, not bit
for bit (tests/models/test_ops.py checks each pair).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

# Rows (tokens) at or below which a product runs blocked over its output (decoding), by the
# operands' bytes per element. Measured on the 2-core Intel Xeon host (AVX-512, AMX), 24 layers
# of Qwen2.5-0.5B-shaped MLP products each from its own weights (cold cache, as in decoding):
# fp32, blocked wins at every row count to 64 (32 rows: 165-183 ms against 244); bf16, it wins
# to 16 rows (8 rows: 42-44 against 51-55 ms) and not from 24 (24 rows: 81-108 against 63-77;
# 64 rows: 112-164 against 92-132). An engine call of 32 bf16 rows x 128 tokens: 133-151 tok/s
# blocked, 159-174 as one product (docs/performance.md).
DECODE_ROWS = {2: 16, 4: 64}
_OUT_BLOCKS = (128, 64)


def matmul_out_in(x: jax.Array, w: jax.Array, dtype=None) -> jax.Array:
  """x [..., in] times w [out, in] -> [..., out] in `dtype` (default x's dtype).

  XLA:CPU's GEMM choices decide decode speed (a Qwen2.5-0.5B-shaped layer stack):
  - with at most DECODE_ROWS[bytes per element] rows (a decode step: 64 fp32 rows, 16 bf16
    rows) the product runs as out/128 blocks of [128, in]. XLA:CPU's GEMM packs its whole
    right-hand operand on every call, which at 8-32 rows costs about as much as the product
    (fp32, 8 rows: 139 ms per step plain, 85 ms blocked); a [128, in] block is packed from
    cache;
  - bf16 / fp16 products accumulate in fp32 (preferred_element_type) and round once: a bf16
    output sends XLA:CPU to a path 5-10x slower (8 rows: 545 ms plain bf16, 37 ms this way),
    and a single row is padded to two, which its bf16 single-row path is equally slow at.
  """
  lead, (out, width) = x.shape[:-1], w.shape
  rows = math.prod(lead)
  x2 = x.reshape(rows, width)
  options = {}
  if x.dtype.itemsize < 4:
    options["preferred_element_type"] = jnp.float32
    if rows == 1:
      x2 = jnp.pad(x2, ((0, 1), (0, 0)))
  block = next((b for b in _OUT_BLOCKS if out % b == 0 and out > b), 0)
  if block and rows <= DECODE_ROWS[x.dtype.itemsize]:
    y = jnp.einsum("mi,boi->bmo", x2, w.reshape(out // block, block, width), **options)
    y = jnp.moveaxis(y, 0, 1).reshape(x2.shape[0], out)
  else:
    y = jnp.einsum("mi,oi->mo", x2, w, **options)
  if x2.shape[0] != rows:  # the barrier keeps XLA from slicing the padding off the operand
    y = jax.lax.optimization_barrier(y)[:rows]
  return y.astype(dtype or x.dtype).reshape(*lead, out)


def swiglu(x: jax.Array, gate, up) -> jax.Array:
  """silu(gate(x)) * up(x) straight from the products' fp32 accumulators, rounded once to the
  projections' compute dtype: XLA:CPU fuses it into one pass, where rounding gate and up to bf16
  first costs two more (Qwen2.5-0.5B shape, bf16, 8192 prompt tokens: 318 -> 274 ms per
  layer)."""
  hidden = jax.nn.silu(gate(x, jnp.float32)) * up(x, jnp.float32)
  return hidden.astype(gate.compute_dtype)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scale: float,
                     softmax) -> jax.Array:
  """One query row per head (a decode step): q [B,1,H,D], head-major k [B,KVH,S,D] and v
  [B,KVH,S,Dv], mask [B,1,S] -> [B,1,H,Dv], as a fused multiply-and-reduce. As a dot, XLA:CPU
  runs one tiny GEMM per (row, kv head) and first converts a bf16 cache to fp32 in a separate
  pass: 24 layers of Qwen2.5-0.5B-shaped attention at 128 rows took 215 ms (bf16) / 146 ms
  (fp32) that way and 56 / 65 ms this way. `softmax` is `models.ops.masked_softmax`."""
  batch, _, heads, dim = q.shape
  kv_heads = k.shape[1]
  qg = q.reshape(batch, kv_heads, heads // kv_heads, 1, dim).astype(jnp.float32)
  logits = jnp.sum(qg * k[:, :, None].astype(jnp.float32), axis=-1) * scale  # [B,KVH,G,S]
  probs = softmax(logits, mask[:, :, None])  # mask [B,1,S]: broadcast over heads
  probs = probs.astype(v.dtype).astype(jnp.float32)  # rounded as the dot path rounds them
  out = jnp.sum(probs[..., None] * v[:, :, None].astype(jnp.float32), axis=-2)
  return out.reshape(batch, 1, heads, v.shape[-1]).astype(v.dtype)


def write_one_slot(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """One new token per row (a decode step) into a bf16 / fp16 buffer [B, ..., S, C] at slot
  start[b], as a select: XLA:CPU scatters into 16-bit buffers by converting the whole buffer to
  fp32 and back (a bf16 Qwen2.5-0.5B-shaped step at 128 rows: ~470 ms with the scatter, ~390 ms
  with this select). Slots past S match nothing: dropped, as the scatter drops them."""
  batch = new.shape[0]
  hit = jnp.arange(buffer.shape[-2])[None, :] == start[:, None]  # [B, S]
  hit = hit.reshape(batch, *([1] * (buffer.ndim - 3)), buffer.shape[-2], 1)
  return jnp.where(hit, jnp.moveaxis(new, 1, -2), buffer)


# XLA:CPU's ragged_dot has no grouped GEMM. A Qwen3-MoE shape (top-8 of 64 experts, d 1024, expert
# width 256), fp32, jitted, medians of 5-20, this project's 2-core host, 2026-11-29:
# - one layer: ragged_dot 82 / 113 / 324 / 1946 ms at 1 / 8 / 64 / 512 tokens (earlier run);
#   every expert on every token, 64 tokens at a time, 20-24 / 78-109 / 580-620 ms at 8 / 64 / 512;
#   `experts` 21-22 / 47-58 / 141-150 ms;
# - 8 layers, each its own weights (cold, as in decoding), 1 / 2 tokens: each token's k experts
#   gathered ([N, k, D, F] copies) 100-112 / 200-221 ms; `experts` 25-26 / 47-50 ms;
# - its tile rows T, 8 layers at 8 / 32 / 64 / 512 tokens: the power of two at most pairs /
#   experts 184-198 / 301-334 / 408-438 / 861-1017 ms, twice that 131-158 / 267-301 / 343-379 /
#   1187-1380 (128 rows), four times 159-179 / 340-363 at 8 / 32 tokens.


def experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
            w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """The dropless expert FFN, each expert on only the tokens routed to it: the (token, expert)
  pairs sorted by expert, each expert's run padded to whole tiles of T rows (T: 1 with fewer
  pairs than experts, else twice the power of two at most pairs / experts, capped at 64),
  then one [T, D] x [D, F] product chain per tile with its expert's weights; tiles past the
  last used one are skipped. The outputs, times their gate weights, are added back to their
  tokens. Static shapes: at most (pairs + (T - 1) * min(E, pairs)) / T tiles (one decode row:
  its k tiles, not k + E).

  The weights are stacked arrays [E, D, F] / [E, F, D], or (the rollout engine's layout,
  `models.moe.MoE.store_per_expert`) sequences of E per-expert arrays: w_gate E arrays [D, 2F]
  holding gate | up side by side (one product for both), w_up None, w_down E arrays [F, D].
  Stacked, XLA copies the tile's expert out of the stack before each product; per expert, a
  switch over the experts runs the products on the weights where they lie (8 tokens through 8
  Qwen3-MoE-shaped layers, cold weights, fp32, this 2-core host: 111-124 ms stacked, 65-66
  per expert; the weights' bytes at 19.5 GB/s take 55)."""
  n, k = expert_ids.shape
  split = not hasattr(w_gate, "shape")  # per-expert arrays
  n_experts, width = len(w_gate) if split else w_gate.shape[0], x.shape[-1]
  pairs = n * k
  per_expert = pairs // n_experts
  tile = min(64, 2 << (per_expert.bit_length() - 1)) if per_expert else 1
  # Tiles used: sum over experts of ceil(count / T) = (pairs + the used experts' padding) / T,
  # with at most T - 1 padding rows for each of at most min(E, pairs) used experts.
  n_tiles = (pairs + (tile - 1) * min(n_experts, pairs)) // tile
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # pairs, grouped by expert
  counts = jnp.bincount(flat, length=n_experts)
  tiles_of = -(-counts // tile)
  tile_end = jnp.cumsum(tiles_of)  # [E]: one past each expert's last tile
  sorted_e = flat[order]
  run_start = jnp.cumsum(counts) - counts
  slot = ((tile_end - tiles_of)[sorted_e] * tile + jnp.arange(pairs) - run_start[sorted_e])
  slot_pair = jnp.full((n_tiles * tile,), pairs, jnp.int32).at[slot].set(order)
  filled = slot_pair < pairs
  token = jnp.where(filled, slot_pair // k, 0)
  gate = jnp.where(filled, weights.reshape(-1)[jnp.minimum(slot_pair, pairs - 1)], 0)
  tile_ids = jnp.arange(n_tiles)
  tile_expert = jnp.minimum(jnp.searchsorted(tile_end, tile_ids, side="right"), n_experts - 1)

  def ffn(xt, gate_w, up_w, down_w):
    if up_w is None:  # gate | up in one array
      both = xt @ gate_w
      gate_x, up_x = both[:, :both.shape[-1] // 2], both[:, both.shape[-1] // 2:]
    else:
      gate_x, up_x = xt @ gate_w, xt @ up_w
    return (jax.nn.silu(gate_x) * up_x) @ down_w

  def one_tile(args):
    xt, e, used = args

    def run(xt):
      if split:  # one branch per expert, each with its own weights
        return jax.lax.switch(e, [functools.partial(ffn, gate_w=g, up_w=None, down_w=d)
                                  for g, d in zip(w_gate, w_down)], xt)
      return ffn(xt, w_gate[e], w_up[e], w_down[e])
    return jax.lax.cond(used, run, lambda xt: jnp.zeros((tile, width), x.dtype), xt)
  out = jax.lax.map(one_tile, (x[token].reshape(n_tiles, tile, width), tile_expert,
                               tile_ids < tile_end[-1]))
  out = out.reshape(-1, width) * gate[:, None].astype(x.dtype)
  return jnp.zeros_like(x).at[token].add(out)


def decode_phases(new_tokens: int) -> int:
  """Cache widths one engine call decodes through: from 128 new tokens, 4 (prompt + 1/4, 2/4,
  3/4 and all of the new tokens; bf16 Qwen2.5-0.5B shape, 128 rows x 128 tokens: 44.6 -> 41.3 s
  per call; each width compiles its own decode loop: ~4x the compile time, 9 -> 37 s there,
  first call minus a warm one)."""
  return 4 if new_tokens >= 128 else 1
