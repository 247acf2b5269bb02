"""Attention layers: grouped-query attention (Llama/Qwen2/Qwen3) and multi-head latent attention
(DeepSeek-V3), the latter optionally with DeepSeek Sparse Attention (DeepSeek-V3.2).

Both take hidden states x [B, T, D], RoPE positions [B, T], a boolean mask [B, T, S] over the
keys they attend to (S = T without a cache, the cache length with one), and optionally one
layer of the KV cache plus the per-row write offset `start` [B].

MLA runs in one of two mathematically equal modes:
- MHA mode (training / full forward without a cache): the kv latent is expanded through
  W_UK / W_UV into per-head keys and values;
- absorbed MQA mode (with a cache, and always under DSA): queries are absorbed through W_UK into
  the latent space, every head attends to the same 576-d latent rows (kv_lora + rope), and the
  result is mapped back through W_UV. The cache holds only those latent rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import kernels
from models.config import ModelConfig
from models.dsa import INDEXER_STAGES, Indexer, indexer_loss
from models import ops
from models.layers import Dense, RMSNorm, apply_rope, param, stored


class OutProj(nnx.Module):
  """Output projection from [B, T, H, Dv] back to the model width."""

  def __init__(self, n_heads: int, head_dim: int, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.compute_dtype = jnp.dtype(cfg.dtype)
    self.kernel = param(rngs, (n_heads, head_dim, cfg.d_model), ("heads", "kv", "embed"),
                        std=cfg.init_std, dtype=cfg.param_dtype)
    self.out_major = False  # True: stored [d_model, heads, head_dim] (`ops.sampler_layout`)

  def store_out_major(self) -> None:
    w = self.kernel[...]  # [*layers, heads, head_dim, d_model]: a stack of layers leads
    self.kernel.value = stored(jnp.moveaxis(w, -1, w.ndim - 3))
    self.out_major = True

  def __call__(self, x: jax.Array) -> jax.Array:
    x, w = x.astype(self.compute_dtype), self.kernel[...].astype(self.compute_dtype)
    if self.out_major:  # as one [.., H * Dv] x [d_model, H * Dv] product (a decode step on CPU)
      return ops.matmul_out_in(x.reshape(*x.shape[:-2], -1), w.reshape(w.shape[0], -1))
    return jnp.einsum("bthv,hvd->btd", x, w)


class GQAttention(nnx.Module):
  """Grouped-query attention with RoPE, optional qkv bias (Qwen2) and q/k RMSNorm (Qwen3)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    hd = cfg.gqa_head_dim
    self.q_proj = Dense(cfg.d_model, (cfg.n_heads, hd), ("embed", "heads", "kv"), cfg,
                        rngs=rngs, bias=cfg.qkv_bias)
    self.k_proj = Dense(cfg.d_model, (cfg.kv_heads, hd), ("embed", "kv_heads", "kv"), cfg,
                        rngs=rngs, bias=cfg.qkv_bias)
    self.v_proj = Dense(cfg.d_model, (cfg.kv_heads, hd), ("embed", "kv_heads", "kv"), cfg,
                        rngs=rngs, bias=cfg.qkv_bias)
    self.o_proj = OutProj(cfg.n_heads, hd, cfg, rngs=rngs)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(hd, cfg, rngs=rngs)
      self.k_norm = RMSNorm(hd, cfg, rngs=rngs)
    else:
      self.q_norm = self.k_norm = None

  def __call__(self, x, positions, mask, layer_cache=None, start=None, **unused):
    del unused
    q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions, self.cfg)
    k = apply_rope(k, positions, self.cfg)
    new_cache = None
    if layer_cache is not None:
      new_cache = {"k": ops.write_slots(layer_cache["k"], k, start),
                   "v": ops.write_slots(layer_cache["v"], v, start)}
      k, v = new_cache["k"].astype(q.dtype), new_cache["v"].astype(q.dtype)
    else:
      k, v = k.swapaxes(1, 2), v.swapaxes(1, 2)
    out = ops.grouped_attention(q, k, v, mask, self.cfg.softmax_scale)
    return self.o_proj(out), new_cache, {}


class MLAttention(nnx.Module):
  """Multi-head latent attention (DeepSeek-V3), with the DSA indexer when cfg.dsa."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    h = cfg.n_heads
    if cfg.q_lora_rank:
      self.wq_a = Dense(cfg.d_model, cfg.q_lora_rank, ("embed", "q_lora"), cfg, rngs=rngs)
      self.q_norm = RMSNorm(cfg.q_lora_rank, cfg, rngs=rngs)
      self.wq_b = Dense(cfg.q_lora_rank, (h, cfg.qk_head_dim), ("q_lora", "heads", "kv"), cfg,
                        rngs=rngs)
      self.wq = None
    else:
      self.wq_a = self.q_norm = self.wq_b = None
      self.wq = Dense(cfg.d_model, (h, cfg.qk_head_dim), ("embed", "heads", "kv"), cfg,
                      rngs=rngs)
    self.wkv_a = Dense(cfg.d_model, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                       ("embed", "kv_lora"), cfg, rngs=rngs)
    self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg, rngs=rngs)
    self.wkv_b = Dense(cfg.kv_lora_rank, (h, cfg.qk_nope_head_dim + cfg.v_head_dim),
                       ("kv_lora", "heads", "kv"), cfg, rngs=rngs, decode_product=False)
    self.wo = OutProj(h, cfg.v_head_dim, cfg, rngs=rngs)
    self.indexer = Indexer(cfg, rngs=rngs) if cfg.dsa else None

  def __call__(self, x, positions, mask, layer_cache=None, start=None, *,
               absorbed: bool | None = None, kernel_backend: str = "auto",
               indexer_stage: str | None = None, token_mask=None, segment_ids=None):
    """`indexer_stage` (DSA, no cache) adds the indexer's KL loss to the returned aux:
    "dense_warmup" attends densely and fits the indexer to the dense attention; "sparse"
    attends over the indexer's top-k and fits it there (models.dsa.indexer_loss).
    `segment_ids` [B, T] (packed sequences, no cache; `mask` already keeps attention inside a
    segment) keep the indexer's top-k inside each query's segment too."""
    cfg = self.cfg
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if self.wq is None:
      q_latent = self.q_norm(self.wq_a(x))
      q = self.wq_b(q_latent)
    else:
      q_latent, q = None, self.wq(x)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    q_pe = apply_rope(q_pe, positions, cfg, interleave=cfg.rope_interleave)
    kv_a = self.wkv_a(x)
    kv_latent = self.kv_norm(kv_a[..., :cfg.kv_lora_rank])
    k_pe = apply_rope(kv_a[..., cfg.kv_lora_rank:], positions, cfg,
                      interleave=cfg.rope_interleave)
    if absorbed is None:
      absorbed = layer_cache is not None or cfg.dsa
    if not absorbed:
      kv = self.wkv_b(kv_latent)
      k_nope, v = kv[..., :nope], kv[..., nope:]
      k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], k_nope.shape[:3] + (rope,))],
                          axis=-1)
      out = ops.grouped_attention(jnp.concatenate([q_nope, q_pe], axis=-1), k.swapaxes(1, 2),
                              v.swapaxes(1, 2), mask, cfg.softmax_scale)
      return self.wo(out), None, {}

    latent_new = jnp.concatenate([kv_latent, k_pe], axis=-1)  # [B, T, kv_lora + rope]
    new_cache = None
    if layer_cache is not None:
      new_cache = dict(layer_cache)
      new_cache["latent"] = ops.write_slots(layer_cache["latent"], latent_new, start)
      latent = new_cache["latent"].astype(latent_new.dtype)
    else:
      latent = latent_new
    w_kv_b = self.wkv_b.kernel[...].astype(q.dtype)  # [kv_lora, H, nope + v]
    w_uk, w_uv = w_kv_b[..., :nope], w_kv_b[..., nope:]
    q_absorbed = jnp.einsum("bthn,chn->bthc", q_nope, w_uk)
    q_full = jnp.concatenate([q_absorbed, q_pe], axis=-1)  # [B, T, H, kv_lora + rope]
    aux: dict[str, Any] = {}
    if self.indexer is not None and indexer_stage == "dense_warmup":
      if layer_cache is not None:
        raise ValueError("indexer_stage='dense_warmup' is a training mode: no KV cache")
      out_latent = self._dense_latent_attention(q_full, latent, mask)
      loss, metrics = indexer_loss(self.indexer, "dense_warmup", x=x, q_latent=q_latent,
                                   positions=positions, q_full=q_full, latent=latent,
                                   scale=cfg.softmax_scale, mask=mask, token_mask=token_mask)
      aux = {"indexer_loss": loss, "indexer_metrics": metrics}
    elif self.indexer is not None:
      index_k_cache = None if layer_cache is None else layer_cache["index_k"]
      indices, index_scores, index_k_cache = self.indexer(
          x, q_latent, positions, index_k_cache=index_k_cache, start=start,
          kernel_backend=kernel_backend, segment_ids=segment_ids)
      if new_cache is not None:
        new_cache["index_k"] = index_k_cache
      out_latent, lse = kernels.sparse_mla(q_full, latent, indices, scale=cfg.softmax_scale,
                                           d_v=cfg.kv_lora_rank, backend=kernel_backend)
      aux = {"index_topk": indices, "index_scores": index_scores}
      if indexer_stage == "sparse":
        if layer_cache is not None:
          raise ValueError("indexer_stage='sparse' is a training mode: no KV cache")
        aux["indexer_loss"], aux["indexer_metrics"] = indexer_loss(
            self.indexer, "sparse", x=x, q_latent=q_latent, positions=positions, q_full=q_full,
            latent=latent, scale=cfg.softmax_scale, indices=indices, lse=lse,
            token_mask=token_mask)
      elif indexer_stage is not None:
        raise ValueError(f"indexer_stage={indexer_stage!r}: must be one of {INDEXER_STAGES}")
    else:
      out_latent = self._dense_latent_attention(q_full, latent, mask)
    out = jnp.einsum("bthc,chv->bthv", out_latent.astype(q.dtype), w_uv)
    return self.wo(out), new_cache, aux

  def _dense_latent_attention(self, q_full, latent, mask):
    logits = jnp.einsum("bthc,bsc->bhts", q_full, latent,
                        preferred_element_type=jnp.float32) * self.cfg.softmax_scale
    probs = ops.masked_softmax(logits, mask[:, None])
    return jnp.einsum("bhts,bsc->bthc", probs.astype(latent.dtype),
                      latent[..., :self.cfg.kv_lora_rank])


def make_attention(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  return GQAttention(cfg, rngs=rngs) if cfg.attention == "gqa" else MLAttention(cfg, rngs=rngs)
