"""Pure-jnp references for the DeepSeek Sparse Attention kernels (contracts in docs/dsa.md).

These are the numerical ground truth for the Pallas kernels and the production path on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def same_segment(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
  """[B, S] and [B, L] segment ids -> bool [B, S, L]: key in the query's segment."""
  if query_segments.shape[0] != key_segments.shape[0]:
    raise ValueError(f"segment_ids rows differ: {query_segments.shape} vs {key_segments.shape}")
  return query_segments[:, :, None] == key_segments[:, None, :]


def lightning_indexer(q: jax.Array, k: jax.Array, w: jax.Array, *, topk: int,
                      causal: bool = True, q_offset: int | jax.Array = 0,
                      segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Top-k key selection by the lightning indexer's score.

  Args:
    q: [B, S, HI, DI] indexer queries.
    k: [B, L, DI] indexer keys (one per token, shared by all indexer heads).
    w: [B, S, HI] per-head weights with every scale already folded in.
    topk: keys kept per query; the output width is K = min(topk, L).
    causal: query t (absolute position q_offset + t) may select keys s' <= q_offset + t.
    q_offset: scalar or [B] absolute position of each row's first query (decode with a cache).
    segment_ids: [B, S] for packed sequences (queries and keys are the same tokens, L == S):
      query t may select key s' only when segment_ids[s'] == segment_ids[t].

  Returns:
    indices [B, S, K] int32 (-1 where fewer than K keys are selectable) and their scores
    [B, S, K] fp32 (-inf at -1).
  """
  length = k.shape[1]
  kk = min(topk, length)
  logits = jnp.einsum("bshd,bld->bshl", q.astype(jnp.float32), k.astype(jnp.float32))
  scores = jnp.einsum("bshl,bsh->bsl", jax.nn.relu(logits), w.astype(jnp.float32))
  if causal:
    offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (q.shape[0],))
    query_pos = offset[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]  # [B, S]
    allowed = jnp.arange(length, dtype=jnp.int32)[None, None, :] <= query_pos[..., None]
    scores = jnp.where(allowed, scores, -jnp.inf)
  if segment_ids is not None:
    scores = jnp.where(same_segment(segment_ids, segment_ids), scores, -jnp.inf)
  top_scores, top_idx = jax.lax.top_k(scores, kk)
  top_idx = jnp.where(jnp.isneginf(top_scores), -1, top_idx).astype(jnp.int32)
  return top_idx, top_scores


def sparse_mla(q: jax.Array, kv: jax.Array, indices: jax.Array, *, scale: float, d_v: int
               ) -> tuple[jax.Array, jax.Array]:
  """Attention of each query token over its own list of latent rows (MLA in MQA mode).

  Args:
    q: [B, S, H, D] queries (D = kv_lora + rope = 576 at full scale).
    kv: [B, L, D] latent cache, shared by all heads; V = kv[..., :d_v].
    indices: [B, S, K] int32 rows of kv per query token; -1 entries are skipped.
    scale: softmax scale.
    d_v: value width.

  Returns:
    out [B, S, H, d_v] (zero for a token with no valid index) and lse [B, S, H] fp32
    (-inf there). A duplicated index is attended once per occurrence.
  """
  valid = indices >= 0
  safe = jnp.where(valid, indices, 0)
  gathered = jax.vmap(lambda rows, idx: rows[idx])(kv, safe)  # [B, S, K, D]
  logits = jnp.einsum("bshd,bskd->bshk", q.astype(jnp.float32),
                      gathered.astype(jnp.float32)) * scale
  logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)
  lse = jax.nn.logsumexp(logits, axis=-1)
  any_valid = jnp.any(valid, axis=-1)[:, :, None]
  probs = jnp.where(any_valid[..., None], jnp.exp(logits - jnp.where(any_valid, lse, 0.0)[..., None]),
                    0.0)
  out = jnp.einsum("bshk,bskd->bshd", probs, gathered[..., :d_v].astype(jnp.float32))
  return out.astype(q.dtype), jnp.where(any_valid, lse, -jnp.inf)
