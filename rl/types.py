"""`Trajectories`: the one record every RL stage reads and extends (DESIGN.md).

Fixed shapes, padded: B rows (prompt x sample), T token positions (prompt then response).
The rollout engine fills the first block; the rewarder adds `scores`, `acc`, `token_rewards`;
the advantage step adds `advantages`, `returns`, `values`. Fields not yet filled are None, so
the record stays a valid pytree at every stage (None is an empty subtree).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from flax import struct

Array = Any  # jax.Array or np.ndarray


@struct.dataclass
class Trajectories:
  tokens: Array  # [B, T] int32: prompt tokens, then response tokens, then padding
  prompt_lens: Array  # [B] int32
  response_mask: Array  # [B, T] 1 only on tokens the policy generated
  logp_old: Array  # [B, T] float32: the sampler's own log-prob of each generated token
  policy_version: Array  # [B, T] int32: which weights produced each token (streaming)
  group_id: Array  # [B] int32: rows with one id share a prompt (GRPO group)
  finished: Array  # [B] bool: stopped on a stop token
  truncated: Array  # [B] bool: hit max_new_tokens without stopping
  routing: Optional[Array] = None  # [B, T, layers, k] expert ids used (keep-routing)
  sample_mask: Optional[Array] = None  # packed top-p/top-k kept set per step (keep-sampling-mask)
  scores: Optional[Array] = None  # [B] shaped outcome reward
  acc: Optional[Array] = None  # [B] verifier accuracy in [0, 1]
  token_rewards: Optional[Array] = None  # [B, T]
  advantages: Optional[Array] = None  # [B, T]
  returns: Optional[Array] = None  # [B, T] critic targets
  values: Optional[Array] = None  # [B, T] critic values at sampling time

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def response_lengths(self) -> np.ndarray:
    """Generated tokens per row (host numpy)."""
    return np.asarray(self.response_mask).astype(bool).sum(-1)
