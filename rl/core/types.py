"""`Trajectories`: the rollout engine's record of a batch of sampled sequences.

Fixed shapes, padded: B rows (prompt x sample), T token positions (prompt then response).
Rewards (rl/jobs/batch.py score_trajectories) and advantages come next to it as per-row arrays; the
update reads one mini-batch dict whose fields rl/train_step.BATCH_FIELDS lists and
rl/train_step.check_batch enforces. Optional fields are None when their feature is off, so the
record stays a valid pytree (None is an empty subtree).
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
  kept_ids: Optional[Array] = None  # [B, T, top_k] int32 kept ids per step, -1 padded
  # (keep-sampling-mask with a truncating sampler; rl/core/sampling.py)

  @property
  def batch_size(self) -> int:
    return self.tokens.shape[0]

  @property
  def response_lengths(self) -> np.ndarray:
    """Generated tokens per row (host numpy)."""
    return np.asarray(self.response_mask).astype(bool).sum(-1)
