"""Fixed-shape KV cache for incremental decoding (prefill + one-token steps).

The cache is a plain pytree so it crosses `jax.jit` and `lax.while_loop` boundaries:
`{"lengths": int32 [B], "layers": ({name: array [B, ..., S, C]}, ...)}`: the slot axis S is
second to last in every array. Row b holds
`lengths[b]` valid tokens in slots [0, lengths[b]); a call with T new tokens writes them at
slots lengths[b] + t (their absolute positions) and attends to slots <= that position, so rows
with prompts of different lengths decode together without recompiling.

Per layer: GQA keeps "k" and "v" head-major [B, KVH, S, Dh] (attention reads each head's keys
as one contiguous [S, Dh] block; token-major storage made XLA:CPU copy the whole cache into that
layout every decode step); MLA keeps the normalised kv latent and the
roped shared key concatenated, "latent" [B, S, kv_lora + rope] (576-d at DeepSeek scale); DSA
adds the indexer keys "index_k" [B, S, DI]. The attention layers write new rows with
`models.ops.write_slots`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from models.attention import ATTENTION
from models.config import ModelConfig

Cache = dict[str, Any]


def layer_cache_shapes(cfg: ModelConfig, batch: int, max_len: int) -> dict[str, tuple]:
  return ATTENTION[cfg.attention].cache_shapes(cfg, batch, max_len)


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> Cache:
  """An empty cache for `batch` rows of up to `max_len` tokens."""
  dt = jnp.dtype(dtype or cfg.dtype)
  layers = tuple({name: jnp.zeros(shape, dt)
                  for name, shape in layer_cache_shapes(cfg, batch, max_len).items()}
                 for _ in range(cfg.n_layers))
  return {"lengths": jnp.zeros((batch,), jnp.int32), "layers": layers}


def slot_count(cache: Cache) -> int:
  """S: the slots each row of `cache` holds (the second-to-last axis of every array)."""
  first = cache["layers"][0]
  return first[next(iter(first))].shape[-2]


def widen(cache: Cache, max_len: int) -> Cache:
  """`cache` with every row's slots extended to `max_len` (new slots empty, lengths kept)."""
  def pad(x):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, max_len - x.shape[-2]), (0, 0)])
  return {"lengths": cache["lengths"], "layers": jax.tree.map(pad, cache["layers"])}


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> int:
  itemsize = jnp.dtype(dtype or cfg.dtype).itemsize
  per_layer = sum(int(jnp.prod(jnp.array(s))) for s in
                  layer_cache_shapes(cfg, batch, max_len).values())
  return per_layer * cfg.n_layers * itemsize
