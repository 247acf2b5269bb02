"""Attention layers: grouped-query attention (Llama/Qwen2/Qwen3) and multi-head latent attention
(DeepSeek-V3), the latter optionally with DeepSeek Sparse Attention (DeepSeek-V3.2).

Every kind takes one call signature: hidden states x [B, T, D], RoPE positions [B, T], a boolean
mask [B, T, S] over the keys it attends to (S = T without a cache, the cache length with one),
optionally one layer of the KV cache plus the per-row write offset `start` [B], and the keywords
`kernel_backend`, `indexer_stage`, `token_mask` and `segment_ids` (DSA's; GQA has no indexer).
It returns (output [B, T, D], the updated layer cache or None, aux dict).

`ATTENTION` at the end holds each kind's facts for the rest of seedrl: its cache shapes, how
tensor parallelism splits it, its FLOPs and activation bytes, and its HF names. A new kind is
its fields in models/config.py and its module and entry here.

MLA runs in one of two mathematically equal modes:
- MHA mode (training / full forward without a cache): the kv latent is expanded through
  W_UK / W_UV into per-head keys and values;
- absorbed MQA mode (with a cache, and always under DSA): queries are absorbed through W_UK into
  the latent space, every head attends to the same 576-d latent rows (kv_lora + rope), and the
  result is mapped back through W_UV. The cache holds only those latent rows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

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

  def __call__(self, x, positions, mask, layer_cache=None, start=None, *,
               kernel_backend: str = "auto", indexer_stage: str | None = None, token_mask=None,
               segment_ids=None):
    """The signature every attention kind takes (module docstring); GQA has no indexer, so
    `kernel_backend`, `token_mask` and `segment_ids` change nothing here."""
    del kernel_backend, token_mask, segment_ids
    if indexer_stage is not None:
      raise ValueError(f"indexer_stage={indexer_stage!r}: attention='gqa' has no DSA indexer")
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
               kernel_backend: str = "auto", indexer_stage: str | None = None, token_mask=None,
               segment_ids=None):
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
    if layer_cache is None and not cfg.dsa:  # MHA mode
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


# ------------------------------------------------------------------------ The kinds' facts


def _gqa_cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> dict[str, tuple]:
  shape = (batch, cfg.kv_heads, max_len, cfg.gqa_head_dim)
  return {"k": shape, "v": shape}


def _mla_cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> dict[str, tuple]:
  shapes = {"latent": (batch, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim)}
  if cfg.dsa:
    shapes["index_k"] = (batch, max_len, cfg.index_head_dim)
  return shapes


def _gqa_pair_terms(cfg: ModelConfig) -> list[tuple[int, int | None]]:
  return [(cfg.n_heads * 2 * cfg.gqa_head_dim, None)]


def _mla_pair_terms(cfg: ModelConfig) -> list[tuple[int, int | None]]:
  if not cfg.dsa:
    return [(cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim), None)]
  # the attention over each query's top-k, and the indexer's scores over every causal key
  return [(cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim), cfg.index_topk),
          (cfg.index_n_heads * cfg.index_head_dim, None)]


def _gqa_activations(cfg: ModelConfig, length: int, tensor: int,
                     kernel_backend: str) -> tuple[float, int]:
  del kernel_backend
  b = jnp.dtype(cfg.dtype).itemsize
  return (2 * cfg.n_heads + 2 * cfg.kv_heads) * cfg.gqa_head_dim * b / tensor, length


def _mla_activations(cfg: ModelConfig, length: int, tensor: int,
                     kernel_backend: str) -> tuple[float, int]:
  b, h = jnp.dtype(cfg.dtype).itemsize, cfg.n_heads
  latent = cfg.q_lora_rank + cfg.kv_lora_rank + cfg.qk_rope_head_dim
  if cfg.dsa:  # absorbed MLA over the indexer's top-k
    wide = h * (cfg.qk_head_dim + (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
                + cfg.v_head_dim)
    keys = cfg.index_topk if kernel_backend in ("reference", "interpret") else 0
    if keys:  # the reference gathers the top-k latents of every query
      wide += keys * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
  else:
    wide = h * (2 * cfg.qk_head_dim + 2 * cfg.v_head_dim)
    keys = length
  return latent * b + wide * b / tensor, keys


def _gqa_from_hf(hf: dict) -> dict:
  if hf.get("mlp_bias"):
    raise ValueError("mlp_bias=True is not supported")
  return dict(n_kv_heads=hf.get("num_key_value_heads") or 0, head_dim=hf.get("head_dim") or 0)


def _gqa_to_hf(cfg: ModelConfig) -> dict:
  return dict(num_key_value_heads=cfg.kv_heads, head_dim=cfg.gqa_head_dim)


def _mla_from_hf(hf: dict) -> dict:
  if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
    raise ValueError("MLA checkpoints need num_key_value_heads == num_attention_heads")
  layer_kinds = hf.get("mlp_layer_types")
  first_k_dense = hf.get("first_k_dense_replace", 0)
  if layer_kinds:
    first_k_dense = layer_kinds.index("sparse") if "sparse" in layer_kinds else len(layer_kinds)
    if any(k != "sparse" for k in layer_kinds[first_k_dense:]):
      raise ValueError(f"mlp_layer_types {layer_kinds}: only a dense prefix is supported")
  return dict(q_lora_rank=hf.get("q_lora_rank") or 0,
              kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
              qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
              rope_interleave=bool(hf.get("rope_interleave", True)),
              n_experts=hf.get("n_routed_experts") or hf.get("num_local_experts"),
              n_experts_per_tok=hf["num_experts_per_tok"],
              moe_mlp_dim=hf["moe_intermediate_size"],
              n_shared_experts=hf.get("n_shared_experts") or 0, first_k_dense=first_k_dense,
              norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
              routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
              n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1)


def _mla_to_hf(cfg: ModelConfig) -> dict:
  return dict(num_key_value_heads=cfg.n_heads, q_lora_rank=cfg.q_lora_rank or None,
              kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
              qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
              head_dim=cfg.qk_rope_head_dim, rope_interleave=cfg.rope_interleave,
              n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
              moe_intermediate_size=cfg.moe_mlp_dim, n_shared_experts=cfg.n_shared_experts,
              first_k_dense_replace=cfg.first_k_dense, n_group=cfg.n_group,
              topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
              norm_topk_prob=cfg.norm_topk_prob)


def _gqa_hf_params(cfg: ModelConfig, to: Any, ours: tuple, theirs: str) -> None:
  hd = cfg.gqa_head_dim
  for name, heads in (("q_proj", cfg.n_heads), ("k_proj", cfg.kv_heads),
                      ("v_proj", cfg.kv_heads)):
    to.linear(ours + (name, "kernel"), f"{theirs}.{name}.weight", (heads, hd))
    if cfg.qkv_bias:
      to.copy(ours + (name, "bias"), f"{theirs}.{name}.bias", (heads, hd))
  to.out_proj(ours + ("o_proj", "kernel"), f"{theirs}.o_proj.weight", cfg.n_heads, hd)
  if cfg.qk_norm:
    to.copy(ours + ("q_norm", "scale"), f"{theirs}.q_norm.weight")
    to.copy(ours + ("k_norm", "scale"), f"{theirs}.k_norm.weight")


def _mla_hf_params(cfg: ModelConfig, to: Any, ours: tuple, theirs: str) -> None:
  h = cfg.n_heads
  if cfg.q_lora_rank:
    to.linear(ours + ("wq_a", "kernel"), f"{theirs}.q_a_proj.weight")
    to.copy(ours + ("q_norm", "scale"), f"{theirs}.q_a_layernorm.weight")
    to.linear(ours + ("wq_b", "kernel"), f"{theirs}.q_b_proj.weight", (h, cfg.qk_head_dim))
    to.rope_columns(ours + ("wq_b", "kernel"))
  else:
    to.linear(ours + ("wq", "kernel"), f"{theirs}.q_proj.weight", (h, cfg.qk_head_dim))
    to.rope_columns(ours + ("wq", "kernel"))
  to.linear(ours + ("wkv_a", "kernel"), f"{theirs}.kv_a_proj_with_mqa.weight")
  to.rope_columns(ours + ("wkv_a", "kernel"))
  to.copy(ours + ("kv_norm", "scale"), f"{theirs}.kv_a_layernorm.weight")
  to.linear(ours + ("wkv_b", "kernel"), f"{theirs}.kv_b_proj.weight",
            (h, cfg.qk_nope_head_dim + cfg.v_head_dim))
  to.out_proj(ours + ("wo", "kernel"), f"{theirs}.o_proj.weight", h, cfg.v_head_dim)
  if cfg.dsa:
    ix, hi = ours + ("indexer",), f"{theirs}.indexer"
    to.linear(ix + ("wq_b", "kernel"), f"{hi}.wq_b.weight",
              (cfg.index_n_heads, cfg.index_head_dim))
    to.linear(ix + ("wk", "kernel"), f"{hi}.wk.weight")
    to.copy(ix + ("k_norm", "scale"), f"{hi}.k_norm.weight")
    to.copy(ix + ("k_norm", "bias"), f"{hi}.k_norm.bias")
    to.linear(ix + ("weights_proj", "kernel"), f"{hi}.weights_proj.weight")


@dataclasses.dataclass(frozen=True)
class AttentionKind:
  """Everything outside its module that seedrl needs of an attention kind (ATTENTION).

  module        the layer, called as the module docstring says
  cache_shapes  (cfg, batch, max_len) -> {name: shape} of one layer's KV cache; its bytes per
                token are `models.cache.cache_bytes(cfg, 1, 1)`
  cache_split   (cfg, tensor) -> how many ways tensor parallelism splits that cache
  tensor_heads  cfg -> the head count that tensor parallelism must divide
  pair_terms    cfg -> [(multiply-adds per (query, key) pair of one layer's forward, the keys
                a query sees at most or None for all causal keys)]: models/flops.py
  activations   (cfg, length, tensor, kernel_backend) -> (bytes per token of the projections'
                outputs, keys per query whose scores are kept): models/memory.py
  hf_read       an HF config.json dict -> our ModelConfig fields (ValueError where unsupported)
  hf_write      cfg -> its config.json fields
  hf_params     (cfg, to, ours, theirs) names each parameter under our path `ours` after its
                HF tensor under `theirs` (`model.layers.{i}.self_attn`) through `to.linear`,
                `to.copy`, `to.out_proj` and `to.rope_columns` (models/hf.param_mapping)
  """
  module: type
  cache_shapes: Callable[[ModelConfig, int, int], dict[str, tuple]]
  cache_split: Callable[[ModelConfig, int], int]
  tensor_heads: Callable[[ModelConfig], int]
  pair_terms: Callable[[ModelConfig], list[tuple[int, int | None]]]
  activations: Callable[[ModelConfig, int, int, str], tuple[float, int]]
  hf_read: Callable[[dict], dict]
  hf_write: Callable[[ModelConfig], dict]
  hf_params: Callable[[ModelConfig, Any, tuple, str], None]


# One entry per `ModelConfig.attention` (models.config.ATTENTION_KINDS).
ATTENTION = {
    "gqa": AttentionKind(
        GQAttention, _gqa_cache_shapes, cache_split=lambda cfg, tensor: tensor,
        tensor_heads=lambda cfg: math.gcd(cfg.n_heads, cfg.kv_heads), pair_terms=_gqa_pair_terms,
        activations=_gqa_activations, hf_read=_gqa_from_hf, hf_write=_gqa_to_hf,
        hf_params=_gqa_hf_params),
    "mla": AttentionKind(
        MLAttention, _mla_cache_shapes, cache_split=lambda cfg, tensor: 1,  # one latent per token
        tensor_heads=lambda cfg: cfg.n_heads, pair_terms=_mla_pair_terms,
        activations=_mla_activations, hf_read=_mla_from_hf, hf_write=_mla_to_hf,
        hf_params=_mla_hf_params),
}


def make_attention(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
  return ATTENTION[cfg.attention].module(cfg, rngs=rngs)
