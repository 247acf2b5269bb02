"""Analytic memory of a model: its parameters built abstractly (nothing allocated), the bytes
of a tree of arrays per device of a sharding, and the activation bytes one token keeps alive
for the backward pass under each rematerialisation policy. launch/dry_run.py reports them for
a config's mesh and models/planner.py ranks meshes with them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import cache as cache_lib
from models import remat as remat_lib
from models.attention import ATTENTION
from models.config import ModelConfig
from models.transformer import ShapeOnlyRngs, Transformer

# Prompt tokens assumed in front of every response when sizing the train step's sequences (at
# most what the model's context leaves next to config.rollout.max_new_tokens).
DEFAULT_PROMPT_LEN = 1024


def default_prompt_len(cfg: ModelConfig, max_new_tokens: int) -> int:
  """DEFAULT_PROMPT_LEN, or what the context leaves beside `max_new_tokens` when less (>= 1):
  the prompt the dry run and the planner size a step's sequences with."""
  return max(1, min(DEFAULT_PROMPT_LEN, cfg.max_seq_len - max_new_tokens))


def abstract_model(cfg: ModelConfig):
  """(graphdef, params, rest) of `Transformer(cfg)` holding jax.ShapeDtypeStructs."""
  model = nnx.eval_shape(lambda: Transformer(cfg, rngs=ShapeOnlyRngs()))
  return nnx.split(model, nnx.Param, ...)


def tree_bytes(tree, shardings=None) -> int:
  """Bytes of a tree of arrays / ShapeDtypeStructs: in total, or per device of `shardings`."""
  leaves = jax.tree.leaves(tree)
  specs = jax.tree.leaves(shardings) if shardings is not None else [None] * len(leaves)
  total = 0
  for leaf, sharding in zip(leaves, specs, strict=True):
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
  return total


def activation_bytes_per_token(cfg: ModelConfig, length: int, *, tensor: int = 1,
                               kernel_backend: str = "tpu", remat: str | None = None,
                               expert: int = 1) -> float:
  """Analytic bytes one token keeps alive in device memory for the backward pass of the policy
  loss (+-2x: XLA fusion decides what is really saved).

  Per layer without rematerialisation: ~6 d-wide residual / norm tensors; the attention
  projections (q, k, v, output, MLA latents); the attention probabilities in fp32 (softmax's
  backward reads its output, not the logits) plus the compute-dtype copy the value product
  reads, over every key (dense attention materialises [heads, T, T]) or over
  the top-k keys under DSA (none with the compiled TPU / GPU kernels, which keep a log-sum-exp);
  the feed-forward's gate, up and product (k routed + shared experts for MoE, plus the
  dispatched token copies). Then the fp32 logits, log-probs, probabilities and logit gradients
  of the vocabulary. Head-, mlp- and vocab-wide terms are divided by the "tensor" axis size.
  On an expert mesh (`expert` > 1) the layer being differentiated also holds the expert-parallel
  exchange's buffers (`exchange_bytes_per_token`).

  The layer being differentiated also holds gradients as large as its activations. `remat`
  (default cfg.remat; models/remat.py): every layer keeps its input and what the policy saves
  (`_layer_activation_bytes`), and the layer being differentiated holds about its whole set
  while its forward is recomputed and differentiated, beside its slice of the scan's stacked
  saved tensors. Offloaded tensors are not counted here
  (see `offloaded_activation_bytes_per_token`). Checked against XLA:CPU's compiled peak of
  small dense and MLA models (tests/models/test_planner.py); the CPU's MoE path computes every expert
  densely, so MoE models compile to ~1.5x this there.
  """
  remat = cfg.remat if remat is None else remat
  layers = [_layer_activation_bytes(cfg, i, length, tensor, kernel_backend, remat)
            for i in range(cfg.n_layers)]
  vocab = 16 * cfg.vocab_size / tensor
  widest = max(layer["all"] for layer in layers)
  kept = "all" if remat == "none" else "device"
  # The scan over layers (models/transformer.py) differentiates one layer at a time from a
  # slice of the stacked saved tensors: one more layer's kept set.
  sliced = max(layer[kept] for layer in layers)
  return (sum(layer[kept] for layer in layers) + widest + sliced + vocab
          + exchange_bytes_per_token(cfg, expert, tensor))


def exchange_bytes_per_token(cfg: ModelConfig, expert: int, tensor: int = 1) -> float:
  """Bytes per token of one MoE layer's expert-parallel exchange (models/moe_ep.py) while it is
  differentiated: the k sent and returned rows, the received and answered rows and the expert
  FFN's gate, up and product over them, each with its gradient. A device receives up to `expert`
  x k rows per local token when dropless (the worst case, all sources to one destination),
  ~capacity_factor x k under a capacity. 0 without a MoE layer or an expert axis."""
  if not cfg.is_moe or expert <= 1:
    return 0.0
  b = jnp.dtype(cfg.dtype).itemsize
  k, d = cfg.n_experts_per_tok, cfg.d_model
  received = k * (cfg.moe_capacity_factor or expert)
  rows = 2 * k * d + 2 * received * d + 3 * received * cfg.moe_mlp_dim / tensor
  return 2 * b * rows


def rollout_bytes(cfg: ModelConfig, *, sequences: int, slots: int, prefill_rows: int,
                  prompt_width: int, new_tokens: int, row_shards: int = 1, tensor: int = 1,
                  expert: int = 1, kept_ids: int = 0, keep_routing: bool = False,
                  kernel_backend: str = "tpu") -> dict[str, float]:
  """Analytic bytes per device of one rollout engine call (rl/rollout/engine.py) beside the
  parameters and training state. Slots, sequences and prefill rows are split over `row_shards`
  (the mesh's batch axes), GQA's KV heads over `tensor`:

    kv_cache  the slots' KV cache at full width (prompt + new tokens)
    records   every sequence's outputs over its full width: token id and log-prob (4 bytes
              each), the kept ids and the routing when recorded
    prefill   one refill: its contexts' KV cache at prompt width (before the copy into the
              slots) and one layer's activations at a time over their tokens (inference: no
              layer keeps anything for a backward pass)
    logits    the fp32 last-position logits of the slots and of the prefill rows
  """
  per = lambda n: -(-n // row_shards)  # noqa: E731
  kv_split = ATTENTION[cfg.attention].cache_split(cfg, tensor)
  width = prompt_width + new_tokens
  record = 8 + 4 * kept_ids + (4 * cfg.n_moe_layers * cfg.n_experts_per_tok
                               if keep_routing and cfg.is_moe else 0)
  layer = (max(_layer_activation_bytes(cfg, i, prompt_width, tensor, kernel_backend,
                                       "full")["all"] for i in range(cfg.n_layers))
           + exchange_bytes_per_token(cfg, expert, tensor) / 2)  # no gradients
  out = {
      "kv_cache": per(slots) * cache_lib.cache_bytes(cfg, 1, width) / kv_split,
      "records": per(sequences) * width * record,
      "prefill": per(prefill_rows) * (cache_lib.cache_bytes(cfg, 1, prompt_width) / kv_split
                                      + prompt_width * layer),
      "logits": 4 * cfg.vocab_size / tensor * (per(slots) + per(prefill_rows)),
  }
  out["total"] = sum(out.values())
  return out


def offloaded_activation_bytes_per_token(cfg: ModelConfig, length: int, *, tensor: int = 1,
                                         kernel_backend: str = "tpu",
                                         remat: str | None = None) -> float:
  """Analytic bytes per token the offloading remat policies keep in pinned host memory."""
  remat = cfg.remat if remat is None else remat
  return sum(_layer_activation_bytes(cfg, i, length, tensor, kernel_backend, remat)["host"]
             for i in range(cfg.n_layers))


def _layer_activation_bytes(cfg: ModelConfig, layer: int, length: int, tensor: int,
                            kernel_backend: str, remat: str) -> dict[str, float]:
  """Per token of one layer: "all" it would keep without remat, "device" / "host" what it
  keeps in device / host memory under `remat`. Saved matmul outputs: the projections, the d-wide
  attention and feed-forward outputs, the gate and up products (2/3 of the feed-forward term)
  and, for "dots", the attention scores (a matmul with batch dimensions)."""
  b = jnp.dtype(cfg.dtype).itemsize
  d, h = cfg.d_model, cfg.n_heads
  proj, keys = ATTENTION[cfg.attention].activations(cfg, length, tensor, kernel_backend)
  scores = (4 + b) * h * keys / tensor + (4 * h + 4 * cfg.index_topk if cfg.dsa else 0)
  if cfg.is_moe_layer(layer):
    experts = cfg.n_experts_per_tok + cfg.n_shared_experts
    ffn = (3 * experts * cfg.moe_mlp_dim * b / tensor + 2 * cfg.n_experts_per_tok * d * b
           + 4 * cfg.n_experts)
  else:
    ffn = 3 * cfg.mlp_dim * b / tensor
  keep_all = 6 * d * b + proj + scores + ffn
  layer_input = d * b
  dots_no_batch = proj + 2 * d * b + 2 * ffn / 3
  saved = {"none": keep_all - layer_input, "full": 0.0, "dots_no_batch": dots_no_batch,
           "dots": dots_no_batch + b * h * keys / tensor,
           "names": len(remat_lib.parse_names(cfg.remat_names)) * d * b}
  offloaded = {"offload_names": "names", "offload_dots_no_batch": "dots_no_batch"}
  if remat in offloaded:
    return {"all": keep_all, "device": layer_input, "host": saved[offloaded[remat]]}
  return {"all": keep_all, "device": layer_input + saved[remat], "host": 0.0}
