"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer that picks, for every query
token, the top-k earlier tokens its MLA heads attend to (spec/dsa.md).

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
from models import cache as cache_lib
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
               kernel_backend: str = "auto"):
    """Returns (indices [B,T,K] int32, scores [B,T,K] fp32, updated index-key cache or None).

    Without a cache, keys are this call's tokens and query t may pick keys <= t; with a cache,
    the new keys are written at slots start[b] + t and query t may pick slots <= start[b] + t.
    """
    q, k, w = self.scores_inputs(x, q_latent, positions)
    if index_k_cache is not None:
      index_k_cache = cache_lib.write(index_k_cache, k, start)
      keys, offset = index_k_cache.astype(k.dtype), start
    else:
      keys, offset = k, 0
    indices, scores = kernels.lightning_indexer(q, keys, w, topk=self.cfg.index_topk,
                                                causal=True, q_offset=offset,
                                                backend=kernel_backend)
    return indices, scores, index_k_cache
