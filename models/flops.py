"""Training FLOPs of a decoder LM, used for model FLOPs utilisation (launch/bench_train.py)
and the planner's step time (models/planner.py).

Per sequence of length L (forward + backward = 3x the forward's matmul FLOPs):
  dense part:     6 * N_matmul * L, N_matmul = active parameters that multiply activations
                  (the embedding lookup does not; a tied LM head does);
  attention part: 3 * n_layers * 2 * heads * (qk_dim + v_dim) * (query, key) pairs, with
                  L (L + 1) / 2 causal pairs, or sum_t min(t + 1, index_topk) under DSA, whose
                  lightning indexer adds 3 * 2 * index_heads * index_head_dim per causal pair.
"""

from __future__ import annotations

import numpy as np

from models.attention import ATTENTION
from models.config import ModelConfig
from models.transformer import param_counts


def matmul_params(cfg: ModelConfig) -> int:
  """Active parameters per token that take part in matmuls."""
  embed = cfg.vocab_size * cfg.d_model
  return param_counts(cfg)["active"] - embed + (embed if cfg.tie_embeddings else 0)


def causal_pairs(lengths, window: int | None = None) -> np.ndarray:
  """(query, key) pairs of causal attention per sequence, each query seeing at most `window`
  keys (DSA top-k) when given."""
  length = np.asarray(lengths, np.float64)
  full = length * (length + 1) / 2
  if window is None:
    return full
  w = float(window)
  return np.where(length <= w, full, w * (w + 1) / 2 + (length - w) * w)


def train_flops(cfg: ModelConfig, lengths) -> dict[str, float]:
  """Training FLOPs (forward + backward) of sequences with the given lengths."""
  lengths = np.asarray(lengths, np.float64)
  dense = 6.0 * matmul_params(cfg) * lengths.sum()
  attention = sum(6.0 * cfg.n_layers * width * causal_pairs(lengths, window).sum()
                  for width, window in ATTENTION[cfg.attention].pair_terms(cfg))
  return {"dense": float(dense), "attention": float(attention),
          "total": float(dense + attention)}

