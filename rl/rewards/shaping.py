"""Reward shaping (spec/rl_algorithms.md section 6). Lengths are counted in tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def overlong_penalty(lengths: jax.Array, *, max_len: int, buffer: int,
                     factor: float = 1.0) -> jax.Array:
  """DAPO soft overlong punishment: 0 up to max_len - buffer tokens, then falling linearly to
  -factor at max_len: min(-(len - (max_len - buffer)) / buffer * factor, 0)."""
  if buffer <= 0 or buffer > max_len:
    raise ValueError(f"overlong buffer={buffer}: must be in [1, max_len={max_len}]")
  exceed = jnp.asarray(lengths, jnp.float32) - (max_len - buffer)
  return jnp.minimum(-exceed / buffer * factor, 0.0)


def place_on_last_token(scores: jax.Array, mask: jax.Array) -> jax.Array:
  """[B] outcome rewards -> [B, T] token rewards on each row's last masked-in token (all zero
  for a row with no response tokens)."""
  m = jnp.asarray(mask, jnp.float32)
  t = jnp.arange(m.shape[1])
  last = jnp.max(jnp.where(m > 0, t[None, :], -1), axis=1)
  onehot = (t[None, :] == last[:, None]).astype(jnp.float32)
  return onehot * jnp.asarray(scores, jnp.float32)[:, None]
