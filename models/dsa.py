"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer that picks, for every query
token, the top-k earlier tokens its MLA heads attend to (docs/dsa.md).

The indexer reads the MLA query latent q_r (shared with the attention) and the hidden state:
  q_I = wq_b(q_r)            [B, T, HI, DI]  (RoPE on the first qk_rope dims, half-split layout)
  k_I = LayerNorm(wk(x))     [B, T, DI]      (one key per token for all heads; RoPE likewise)
  w   = weights_proj(x) * HI^-0.5 * DI^-0.5  [B, T, HI] (fp32)
  I[t, s] = sum_h w[t, h] * ReLU(q_I[t, h] . k_I[s]);  top-k over s <= t.
Selection happens in `kernels.lightning_indexer`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import kernels
from models import ops
from models.config import ModelConfig
from models.layers import Dense, LayerNorm, apply_rope


class Indexer(nnx.Module):
  """The lightning indexer of one DSA layer."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.wq_b = Dense(cfg.q_lora_rank, (cfg.index_n_heads, cfg.index_head_dim),
                      ("q_lora", "index_heads", "kv"), cfg, rngs=rngs)
    self.wk = Dense(cfg.d_model, cfg.index_head_dim, ("embed", "kv"), cfg, rngs=rngs)
    self.k_norm = LayerNorm(cfg.index_head_dim, cfg, rngs=rngs)
    self.weights_proj = Dense(cfg.d_model, cfg.index_n_heads, ("embed", "index_heads"), cfg,
                              rngs=rngs)

  def _rope_front(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    rope = self.cfg.qk_rope_head_dim
    return jnp.concatenate(
        [apply_rope(x[..., :rope], positions, self.cfg, interleave=False), x[..., rope:]],
        axis=-1)

  def scores_inputs(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array):
    """Indexer queries [B,T,HI,DI], keys [B,T,DI] and folded head weights [B,T,HI] (fp32)."""
    cfg = self.cfg
    q = self._rope_front(self.wq_b(q_latent), positions)
    k = self._rope_front(self.k_norm(self.wk(x)), positions)
    w = self.weights_proj(x).astype(jnp.float32)
    w = w * (cfg.index_n_heads**-0.5) * (cfg.index_head_dim**-0.5)
    return q, k, w

  def __call__(self, x, q_latent, positions, *, index_k_cache=None, start=None,
               kernel_backend: str = "auto", segment_ids=None):
    """Returns (indices [B,T,K] int32, scores [B,T,K] fp32, updated index-key cache or None).

    Without a cache, keys are this call's tokens and query t may pick keys <= t (of its own
    segment when `segment_ids` [B,T] mark packed sequences); with a cache, the new keys are
    written at slots start[b] + t and query t may pick slots <= start[b] + t.
    """
    q, k, w = self.scores_inputs(x, q_latent, positions)
    if index_k_cache is not None:
      index_k_cache = ops.write_slots(index_k_cache, k, start)
      keys, offset = index_k_cache.astype(k.dtype), start
    else:
      keys, offset = k, 0
    indices, scores = kernels.lightning_indexer(q, keys, w, topk=self.cfg.index_topk,
                                                causal=True, q_offset=offset,
                                                segment_ids=segment_ids,
                                                backend=kernel_backend)
    return indices, scores, index_k_cache


# Indexer training loss (docs/dsa.md, "Indexer training loss") ---------------------------------
#
# Two stages, picked by name (a config string):
# - "dense_warmup": the main model is frozen and attends densely; the indexer learns to match
#   the head-summed dense attention over every causal key.
# - "sparse": the model attends to the indexer's top-k; both distributions are restricted to
#   the selected set. The indexer reads stop-gradient'ed inputs and the attention target is
#   stop-gradient'ed, so the indexer learns only from this KL and the main model only from its
#   own (LM or RL) loss; the top-k selection itself passes no gradient to the indexer.
# The score scaling is kept (it changes the KL, not the top-k).

INDEXER_STAGES = ("dense_warmup", "sparse")


def indexer_logits(q: jax.Array, k: jax.Array, w: jax.Array, *, causal: bool = True,
                   q_offset: int | jax.Array = 0) -> jax.Array:
  """Full indexer scores I [B, T, L] fp32 (-inf at keys a query may not select).

  Materialises [B, T, HI, L]: meant for the dense warm-up at training lengths (chunk the
  queries beyond that)."""
  logits = jnp.einsum("bthd,bld->bthl", q.astype(jnp.float32), k.astype(jnp.float32))
  scores = jnp.einsum("bthl,bth->btl", jax.nn.relu(logits), w.astype(jnp.float32))
  if not causal:
    return scores
  offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (q.shape[0],))
  query_pos = offset[:, None] + jnp.arange(q.shape[1], dtype=jnp.int32)[None, :]
  allowed = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :] <= query_pos[..., None]
  return jnp.where(allowed, scores, -jnp.inf)


def selected_indexer_logits(q: jax.Array, k: jax.Array, w: jax.Array,
                            indices: jax.Array) -> jax.Array:
  """Indexer scores at each token's selected keys: [B, T, K] fp32 (-inf at -1)."""
  valid = indices >= 0
  keys = jax.vmap(lambda rows, idx: rows[idx])(k, jnp.where(valid, indices, 0))  # [B,T,K,DI]
  logits = jnp.einsum("bthd,btkd->bthk", q.astype(jnp.float32), keys.astype(jnp.float32))
  scores = jnp.einsum("bthk,bth->btk", jax.nn.relu(logits), w.astype(jnp.float32))
  return jnp.where(valid, scores, -jnp.inf)


def dense_attention_mass(q_full: jax.Array, latent: jax.Array, mask: jax.Array, *,
                         scale: float) -> jax.Array:
  """Head-summed dense attention probabilities [B, T, S] fp32 of absorbed MLA
  (q_full [B,T,H,D], latent [B,S,D], mask [B,T,S]); zero where masked."""
  logits = jnp.einsum("bthc,bsc->bhts", q_full.astype(jnp.float32),
                      latent.astype(jnp.float32)) * scale
  logits = jnp.where(mask[:, None], logits, -jnp.inf)
  peak = jnp.max(logits, axis=-1, keepdims=True)
  weights = jnp.exp(logits - jnp.where(jnp.isfinite(peak), peak, 0.0))
  probs = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)
  return jnp.sum(probs, axis=1)


def selected_attention_mass(q_full: jax.Array, latent: jax.Array, indices: jax.Array,
                            lse: jax.Array, *, scale: float) -> jax.Array:
  """Head-summed sparse attention probabilities at each selected slot [B, T, K] fp32, from the
  log-sum-exp that `kernels.sparse_mla` returns (P = exp(scale q.k - lse)); zero at -1."""
  valid = indices >= 0
  rows = jax.vmap(lambda r, idx: r[idx])(latent, jnp.where(valid, indices, 0))  # [B,T,K,D]
  logits = jnp.einsum("bthc,btkc->bthk", q_full.astype(jnp.float32),
                      rows.astype(jnp.float32)) * scale
  lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
  probs = jnp.where(valid[:, :, None, :], jnp.exp(logits - lse[..., None]), 0.0)
  return jnp.sum(probs, axis=2)


def kl_to_indexer(target_mass: jax.Array, index_logits: jax.Array,
                  valid: jax.Array) -> jax.Array:
  """Per-token KL(p || softmax(I)) [B, T] over the valid keys, p = target_mass L1-normalised
  (0 log 0 = 0; a token without valid keys gives 0)."""
  mass = jnp.where(valid, target_mass, 0.0)
  p = mass / jnp.maximum(jnp.sum(mass, axis=-1, keepdims=True), 1e-30)
  logits = jnp.where(valid, index_logits, -jnp.inf)
  peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  shifted = logits - jnp.where(jnp.isfinite(peak), peak, 0.0)
  log_norm = jnp.log(jnp.sum(jnp.where(valid, jnp.exp(shifted), 0.0), axis=-1, keepdims=True))
  log_q = jnp.where(valid, shifted - log_norm, 0.0)
  log_p = jnp.log(jnp.where(p > 0, p, 1.0))
  return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def topk_overlap(target_mass: jax.Array, index_logits: jax.Array, valid: jax.Array,
                 k: int) -> jax.Array:
  """Per-token |top-k of the attention mass & top-k of the indexer score| / min(k, valid keys)
  [B, T] (over the valid keys; 0 for a token without any)."""
  k = min(k, valid.shape[-1])
  neg = -jnp.inf
  _, top_target = jax.lax.top_k(jnp.where(valid, target_mass, neg), k)
  _, top_index = jax.lax.top_k(jnp.where(valid, index_logits, neg), k)
  lead = tuple(jnp.arange(n).reshape((-1,) + (1,) * (valid.ndim - 1 - i))
               for i, n in enumerate(valid.shape[:-1]))

  def members(top):
    return jnp.zeros(valid.shape, bool).at[lead + (top,)].set(True) & valid
  shared = jnp.sum(members(top_target) & members(top_index), axis=-1)
  count = jnp.minimum(jnp.sum(valid, axis=-1), k)
  return shared / jnp.maximum(count, 1)


def indexer_loss(indexer: Indexer, stage: str, *, x: jax.Array, q_latent: jax.Array,
                 positions: jax.Array, q_full: jax.Array, latent: jax.Array, scale: float,
                 mask: jax.Array | None = None, indices: jax.Array | None = None,
                 lse: jax.Array | None = None, token_mask: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The indexer's KL loss of one DSA layer (no cache) and its metrics.

  Args:
    indexer: the layer's Indexer; stage: one of INDEXER_STAGES.
    x, q_latent, positions: the attention input [B,T,d_model], the MLA query latent
      [B,T,q_lora] and RoPE positions [B,T]; detached here.
    q_full, latent: absorbed queries [B,T,H,D] and latent rows [B,T,D] of the main attention;
      detached here (the target never trains the model).
    scale: the main attention's softmax scale.
    mask: [B,T,T] keys each query attends to ("dense_warmup").
    indices, lse: the selection [B,T,K] and `kernels.sparse_mla`'s lse [B,T,H] ("sparse").
    token_mask: [B,T] tokens that count (default all).

  Returns:
    L_I = sum over counted tokens of KL(p_t || softmax(I_t)), and metrics: indexer_kl (mean
    per counted token) and indexer_topk_overlap ("dense_warmup": top-index_topk agreement of
    dense attention and indexer over all causal keys, i.e. the selection's recall of the
    attention's top-k; "sparse": top-(index_topk // 8) agreement inside the selected set).
  """
  if stage not in INDEXER_STAGES:
    raise ValueError(f"indexer stage {stage!r}: must be one of {INDEXER_STAGES}")
  sg = jax.lax.stop_gradient
  q_i, k_i, w_i = indexer.scores_inputs(sg(x), sg(q_latent), positions)
  q_full, latent = sg(q_full), sg(latent)
  topk = indexer.cfg.index_topk
  if stage == "dense_warmup":
    if mask is None:
      raise ValueError("indexer stage 'dense_warmup' needs the attention mask")
    target = dense_attention_mass(q_full, latent, mask, scale=scale)
    logits = jnp.where(mask, indexer_logits(q_i, k_i, w_i, causal=False), -jnp.inf)
    valid, overlap_k = mask, topk
  else:
    if indices is None or lse is None:
      raise ValueError("indexer stage 'sparse' needs the selected indices and sparse_mla's lse")
    target = selected_attention_mass(q_full, latent, indices, sg(lse), scale=scale)
    logits = selected_indexer_logits(q_i, k_i, w_i, indices)
    valid, overlap_k = indices >= 0, max(1, topk // 8)
  kl = kl_to_indexer(sg(target), logits, valid)
  overlap = topk_overlap(target, sg(logits), valid, overlap_k)
  weight = jnp.ones(kl.shape, jnp.float32) if token_mask is None else token_mask.astype(
      jnp.float32)
  counted = jnp.maximum(jnp.sum(weight), 1.0)
  loss = jnp.sum(kl * weight)
  metrics = {"indexer_kl": sg(loss / counted),
             "indexer_topk_overlap": sg(jnp.sum(overlap * weight) / counted)}
  return loss, metrics
