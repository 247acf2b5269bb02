"""The decoder-only language model shared by the policy, the reference model, the critic and the
reward models: one trunk, an LM head (logits) or a scalar head (values / rewards).

Contract: `model(tokens)` with int32 tokens [B, T] returns logits [B, T, V] (or values [B, T]
for a scalar head). `model.forward(...)` returns the richer `ModelOutput`: the updated KV cache,
the MoE expert ids per token and layer (for keep-routing), router statistics and, under DSA,
the indexer's top-k selections.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

import kernels
from models import cache as cache_lib
from models import remat as remat_lib
from models.attention import make_attention
from models.config import ModelConfig, get_config
from models.layers import MLP, Dense, Embed, RMSNorm
from models import moe
from models.moe import MoE, RouterStats


class ModelOutput(NamedTuple):
  logits: jax.Array | None  # [B, T, V] fp32 (LM head)
  values: jax.Array | None  # [B, T] fp32 (scalar head)
  cache: dict | None
  routing: jax.Array | None  # [B, T, n_moe_layers, k] int32 expert ids
  router_stats: RouterStats | None  # fields stacked over MoE layers: [n_moe_layers, E] ...
  index_topk: jax.Array | None  # indexer top-k indices [n_layers, B, T, K] (DSA)
  index_scores: jax.Array | None  # their indexer scores [n_layers, B, T, K]
  indexer_loss: jax.Array | None = None  # summed over DSA layers and tokens (indexer_stage)
  indexer_metrics: dict | None = None  # indexer_kl, indexer_topk_overlap: means over layers


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: ModelConfig, layer: int, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
    self.attn = make_attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
    self.is_moe = cfg.is_moe_layer(layer)
    self.mlp = MoE(cfg, rngs=rngs) if self.is_moe else MLP(cfg, cfg.mlp_dim, rngs=rngs)

  def __call__(self, x, positions, mask, *, layer_cache=None, start=None, expert_ids=None,
               token_mask=None, kernel_backend="auto", moe_dispatch=None, indexer_stage=None,
               segment_ids=None):
    attn_in = remat_lib.tag(self.attn_norm(x), "attn_in")
    attn_out, new_cache, attn_aux = self.attn(
        attn_in, positions, mask, layer_cache, start, kernel_backend=kernel_backend,
        indexer_stage=indexer_stage, token_mask=token_mask, segment_ids=segment_ids)
    x = x + remat_lib.tag(attn_out, "attn_out")
    h = remat_lib.tag(self.mlp_norm(x), "mlp_in")
    if self.is_moe:
      mlp_out, ids, stats = self.mlp(h, expert_ids=expert_ids, token_mask=token_mask,
                                     dispatch=moe_dispatch)
    else:
      mlp_out, ids, stats = self.mlp(h), None, None
    return x + remat_lib.tag(mlp_out, "mlp_out"), new_cache, ids, stats, attn_aux


class Transformer(nnx.Module):
  """Decoder-only LM (dense or MoE; GQA, MLA or MLA+DSA) with an LM or scalar head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embed(cfg, rngs=rngs)
    # One DecoderLayer per run of identical layers (cfg.layer_stacks), its variables stacked
    # on a leading "layers" axis; forward scans over them. Built layer by layer in order, so
    # the parameters equal those of unstacked layers drawn from the same rngs.
    self.stacks = nnx.List([
        stack_layers([DecoderLayer(cfg, i, rngs=rngs) for i in range(start, start + count)])
        for start, count in cfg.layer_stacks])
    self.final_norm = RMSNorm(cfg.d_model, cfg, rngs=rngs)
    if cfg.head == "scalar":
      self.head = Dense(cfg.d_model, 1, ("embed", None), cfg, rngs=rngs)
    elif cfg.tie_embeddings:
      self.head = None
    else:
      self.head = Dense(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), cfg, rngs=rngs)

  def __call__(self, tokens: jax.Array, **kwargs: Any) -> jax.Array:
    out = self.forward(tokens, **kwargs)
    return out.values if self.cfg.head == "scalar" else out.logits

  def layer(self, i: int) -> DecoderLayer:
    """Layer i as a DecoderLayer of its own: a copy of its slice of its stack, to inspect or
    call alone (writes to it do not reach the model)."""
    for (start, count), stack in zip(self.cfg.layer_stacks, self.stacks, strict=True):
      if start <= i < start + count:
        if isinstance(stack, nnx.List):
          return stack[i - start]
        graphdef, state = nnx.split(stack)
        def one(v, j=i - start):
          axes = v.get_metadata().get("logical_axes")
          updates = {} if axes is None else {"logical_axes": tuple(axes[1:])}
          return v.replace(value=v.get_value()[j], **updates)
        return nnx.merge(graphdef, jax.tree.map(one, state,
                                                is_leaf=lambda x: isinstance(x, nnx.Variable)))
    raise IndexError(f"layer {i}: the model has {self.cfg.n_layers} layers")

  def unstack_layers(self) -> None:
    """Replaces each stack by its layers (an nnx.List of `layer(i)` copies), in place; forward
    then runs them one by one. The CPU rollout engine's weight layout
    (`models.ops.sampler_layout`) does this in its own copy of the weights: a decode step then
    reads each layer's weights where they lie instead of slicing them out of the
    stack (d_model 512, 8 layers, 32 rows x 256 tokens on this 2-core CPU, one run each: 651
    tok/s sliced, 798 unstacked, 932 with the layers never stacked; runs vary by ~15%)."""
    for g, (first, count) in enumerate(self.cfg.layer_stacks):
      if not isinstance(self.stacks[g], nnx.List):
        self.stacks[g] = nnx.List([self.layer(first + j) for j in range(count)])

  def init_cache(self, batch: int, max_len: int, dtype: str | None = None) -> dict:
    return cache_lib.init_cache(self.cfg, batch, max_len, dtype)

  def forward(self, tokens: jax.Array, *, positions: jax.Array | None = None,
              segment_ids: jax.Array | None = None, cache: dict | None = None,
              num_new: jax.Array | None = None, routing: jax.Array | None = None,
              token_mask: jax.Array | None = None, kernel_backend: str | None = None,
              moe_dispatch: str | None = None,
              indexer_stage: str | None = None,
              head_at: jax.Array | None = None) -> ModelOutput:
    """Runs the model.

    Args:
      tokens: int32 [B, T].
      positions: int32 [B, T] RoPE positions (default 0..T-1); ignored with a cache, where row b's
        tokens sit at positions cache["lengths"][b] + t.
      segment_ids: int32 [B, T] for packed sequences (no cache): attention, and the DSA
        indexer's top-k, stay inside a segment; give each document positions from 0.
      cache: a KV cache from `init_cache`; the new tokens are appended and the updated cache
        returned.
      num_new: int32 [B] how many of the T tokens are real per row (right-padded prefill);
        the cache lengths advance by this (default T).
      routing: int32 [B, T, n_moe_layers, k] expert ids to replay (keep-routing).
      token_mask: [B, T] tokens that count in the router statistics (default all).
      kernel_backend: DSA kernel backend ("auto", "reference", "interpret", "gpu", "tpu");
        default: the model config's `kernel_backend` (config.kernel_backend of a run).
      moe_dispatch: override cfg.moe_dispatch ("ragged" or "dense").
      indexer_stage: DSA training only: "dense_warmup" or "sparse" adds the indexer KL loss
        (summed over layers and the tokens of `token_mask`) to the output.
      head_at: int32 [B]: the head runs at row b's position head_at[b] only, so logits (values)
        are [B, 1, V] ([B, 1]): a prefill needs the last prompt position's, and the full
        [B, T, V] vocabulary projection would cost T times the FLOPs and memory.
    """
    cfg = self.cfg
    kernel_backend = kernel_backend or cfg.kernel_backend
    if indexer_stage is not None and not cfg.dsa:
      raise ValueError(f"indexer_stage={indexer_stage!r} needs a DSA model (cfg.dsa=True)")
    batch, steps = tokens.shape
    if cache is not None:
      start = cache["lengths"]
      positions = start[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
      key_len = cache_lib.slot_count(cache)
      mask = jnp.arange(key_len)[None, None, :] <= positions[:, :, None]
    else:
      start = None
      if positions is None:
        positions = jnp.broadcast_to(jnp.arange(steps, dtype=jnp.int32), (batch, steps))
      idx = jnp.arange(steps)
      mask = jnp.broadcast_to(idx[None, :] <= idx[:, None], (batch, steps, steps))
      if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if segment_ids is not None and cache is not None:
      raise ValueError("segment_ids (packed sequences) are a training input: no KV cache")
    if routing is not None and routing.shape[2] != cfg.n_moe_layers:
      raise ValueError(f"routing has {routing.shape[2]} MoE layers, the model has "
                       f"{cfg.n_moe_layers}")

    x = self.embed(tokens)
    chosen = remat_lib.policy(cfg.remat, cfg.remat_names) if cache is None else None
    new_layers, all_ids, all_stats, aux_out = [], [], [], []
    moe_index = 0
    def run_layer(layer, x, layer_cache, expert_ids):
      return layer(kernels.constrain_rows(x), positions, mask, layer_cache=layer_cache,
                   start=start, expert_ids=expert_ids, token_mask=token_mask,
                   kernel_backend=kernel_backend, moe_dispatch=moe_dispatch,
                   indexer_stage=indexer_stage, segment_ids=segment_ids)
    for (first, count), stack in zip(cfg.layer_stacks, self.stacks, strict=True):
      is_moe = cfg.is_moe_layer(first)
      expert_ids = (None if routing is None or not is_moe else
                    jnp.moveaxis(routing[:, :, moe_index:moe_index + count], 2, 0))
      if cache is None and not isinstance(stack, nnx.List):
        # Training and scoring: one scan over the stack, remat per layer (models/remat.py).
        graphdef, state = nnx.split(stack)

        def body(x, xs, graphdef=graphdef):
          x, _, ids, stats, aux = run_layer(nnx.merge(graphdef, xs["state"]), x, None,
                                            xs.get("expert_ids"))
          return x, (ids, stats, aux)
        if chosen is not None:
          body = jax.checkpoint(body, policy=chosen, prevent_cse=False)
        xs = {"state": state} if expert_ids is None else {"state": state,
                                                          "expert_ids": expert_ids}
        x, (ids, stats, aux) = jax.lax.scan(body, x, xs, unroll=1 if cfg.scan_layers else True)
      else:
        # With a KV cache (prefill, decode), or unstacked (`unstack_layers`): layer by layer,
        # each layer's cache updated in place. Under a scan the per-layer caches would pass
        # through its stacked outputs, a copy of the whole cache per step (decode measured
        # 2.1x slower on CPU: 440 against 932 tok/s, the model of `unstack_layers`).
        outs = []
        for j in range(count):
          x, layer_cache, *out = run_layer(
              self.layer(first + j), x, None if cache is None else cache["layers"][first + j],
              None if expert_ids is None else expert_ids[j])
          new_layers.append(layer_cache)
          outs.append(out)
        ids, stats, aux = jax.tree.map(lambda *a: jnp.stack(a), *outs)
      if is_moe:
        moe_index += count
        all_ids.append(ids)  # [count, B, T, k]
        all_stats.append(stats)
      aux_out.append(aux)
    aux = {key: jnp.concatenate([a[key] for a in aux_out]) for key in ("index_topk",
           "index_scores", "indexer_loss") if key in aux_out[0]}
    if "indexer_metrics" in aux_out[0]:
      aux["indexer_metrics"] = jax.tree.map(lambda *xs: jnp.mean(jnp.concatenate(xs)),
                                            *[a["indexer_metrics"] for a in aux_out])
    if head_at is not None:
      x = x[jnp.arange(batch), head_at][:, None]
    x = self.final_norm(x)

    logits = values = None
    if cfg.head == "scalar":
      values = self.head(x)[..., 0].astype(jnp.float32)
    elif self.head is None:
      logits = self.embed.attend(x)
    else:
      logits = self.head(x, jnp.float32)

    new_cache = None
    if cache is not None:
      advance = jnp.full((batch,), steps, jnp.int32) if num_new is None else num_new
      new_cache = {"lengths": cache["lengths"] + advance.astype(jnp.int32),
                   "layers": tuple(new_layers)}
    return ModelOutput(
        logits=logits, values=values, cache=new_cache,
        routing=jnp.moveaxis(jnp.concatenate(all_ids), 0, 2) if all_ids else None,
        router_stats=(jax.tree.map(lambda *xs: jnp.concatenate(xs), *all_stats)
                      if all_stats else None),
        index_topk=aux.get("index_topk"), index_scores=aux.get("index_scores"),
        indexer_loss=jnp.sum(aux["indexer_loss"]) if "indexer_loss" in aux else None,
        indexer_metrics=aux.get("indexer_metrics"))


def update_router_biases(model: Transformer, tokens_per_expert: jax.Array, rate: float) -> None:
  """One aux-loss-free balancing step (models.moe.aux_free_bias_update) on the router bias of
  every "sigmoid_noaux" MoE layer, in place; tokens_per_expert [n_moe_layers, E] is the load
  the step saw (ModelOutput.router_stats.tokens_per_expert, summed over its micro-batches)."""
  moe_index = 0
  for (_, count), stack in zip(model.cfg.layer_stacks, model.stacks, strict=True):
    if not stack.is_moe:
      continue
    bias = stack.mlp.router.bias  # [count, E]
    if bias is not None:
      bias.value = moe.aux_free_bias_update(
          bias.value, tokens_per_expert[moe_index:moe_index + count], rate)
    moe_index += count
  if moe_index != len(tokens_per_expert):
    raise ValueError(f"tokens_per_expert has {len(tokens_per_expert)} MoE layers, the model "
                     f"has {moe_index}")


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
  """Identical layers as one DecoderLayer whose every variable is the layers' stacked on a
  new leading axis (logical axis "layers", never sharded), for `jax.lax.scan`."""
  graphdef = nnx.graphdef(layers[0])

  def stack(*variables):
    first = variables[0]
    axes = first.get_metadata().get("logical_axes")
    updates = {} if axes is None else {"logical_axes": ("layers",) + tuple(axes)}
    return first.replace(value=jnp.stack([v.get_value() for v in variables]), **updates)
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  state = jax.tree.map(stack, *[nnx.state(layer) for layer in layers], is_leaf=is_var)
  return nnx.merge(graphdef, state)


def build(cfg: ModelConfig | str, *, seed: int = 0, **overrides: Any) -> Transformer:
  """Builds a model from a config or a preset name (with field overrides)."""
  if isinstance(cfg, str):
    cfg = get_config(cfg, **overrides)
  elif overrides:
    cfg = cfg.replace(**overrides)
  return Transformer(cfg, rngs=nnx.Rngs(params=seed))


class ShapeOnlyRngs:
  """Stands in for nnx.Rngs where only shapes matter. nnx.Rngs bumps a counter Variable per
  draw, and inside a trace each bump formats an error message that walks the whole trace (jax
  0.10): quadratic, minutes for the 61-layer 671B model. One fixed key gives the same shapes."""

  def params(self) -> jax.Array:
    return jax.random.key(0)


@functools.lru_cache(maxsize=32)
def param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Total and per-token active parameter counts, computed abstractly (no allocation)."""
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=ShapeOnlyRngs()))
  params = nnx.state(abstract, nnx.Param)
  total = sum(_numel(x.shape) for x in jax.tree.leaves(params))
  inactive = 0
  if cfg.is_moe:
    per_expert = 3 * cfg.d_model * cfg.moe_mlp_dim
    inactive = cfg.n_moe_layers * (cfg.n_experts - cfg.n_experts_per_tok) * per_expert
  return {"total": total, "active": total - inactive}


def _numel(shape) -> int:
  n = 1
  for s in shape:
    n *= int(s)
  return n
