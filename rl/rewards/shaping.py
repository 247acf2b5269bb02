"""Reward shaping: DAPO's overlong penalty (the RL algorithms' section 6), DeepSeek-V3.2's
length penalty and language-consistency reward. Lengths are counted in tokens."""

from __future__ import annotations

import unicodedata
from collections import Counter

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


def length_penalty(lengths: jax.Array, *, max_len: int, coef: float) -> jax.Array:
  """DeepSeek-V3.2's length penalty beside rule-based outcomes: -coef * length / max_len, from
  0 for an empty response to -coef at the response budget."""
  return -coef * jnp.asarray(lengths, jnp.float32) / max_len


def script_of(char: str) -> str | None:
  """The Unicode script of a letter, as the first word of its name ("LATIN", "CYRILLIC", "CJK",
  "HIRAGANA", ...); None for a character that is not a letter (digits, punctuation, space)."""
  if not char.isalpha():
    return None
  name = unicodedata.name(char, "")
  return name.split(" ", 1)[0] if name else None


def language_consistency(prompt: str, response: str) -> float:
  """DeepSeek-V3.2's language-consistency reward: the share of the response's letters written
  in the prompt's script (the most common script of the prompt's letters). 1.0 when either side
  has no letters: nothing in the response is in another language."""
  prompt_scripts = Counter(filter(None, map(script_of, prompt)))
  response_scripts = [s for s in map(script_of, response) if s is not None]
  if not prompt_scripts or not response_scripts:
    return 1.0
  script = prompt_scripts.most_common(1)[0][0]
  return sum(s == script for s in response_scripts) / len(response_scripts)
