"""Building blocks shared by every architecture: parameters with logical axes, dense
projections, norms, rotary position embeddings (plain and YaRN) and the SwiGLU MLP.

Every parameter carries `logical_axes` metadata (e.g. ("embed", "mlp")); `models/sharding.py`
maps those names to mesh axes through one rules table.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models import ops
from models.config import ModelConfig, yarn_get_mscale


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], *,
          std: float | None = None, init: str = "normal", dtype: str = "float32") -> nnx.Param:
  """A parameter with logical axis names; init is "normal" (given std), "zeros" or "ones"."""
  if len(shape) != len(axes):
    raise ValueError(f"shape {shape} and logical axes {axes} differ in rank")
  dt = jnp.dtype(dtype)
  if init == "normal":
    value = (std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)).astype(dt)
  elif init == "zeros":
    value = jnp.zeros(tuple(shape), dt)
  elif init == "ones":
    value = jnp.ones(tuple(shape), dt)
  else:
    raise ValueError(f"unknown init {init!r}")
  return nnx.Param(value, logical_axes=tuple(axes))


class Dense(nnx.Module):
  """y = x @ W (+ b) over the last axis; W is [in, *out] so heads can be their own axis, or
  [*out, in] in the CPU rollout engine's layout (`models.ops.sampler_layout`).

  `decode_product=False` marks a kernel decode reads as a weight rather than multiplies by
  (MLA's absorbed W_UK / W_UV): the sampler layout leaves it [in, *out]."""

  def __init__(self, in_dim: int, out_shape: int | Sequence[int], axes: Sequence[str | None],
               cfg: ModelConfig, *, rngs: nnx.Rngs, bias: bool = False,
               decode_product: bool = True):
    out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
    self.out_shape = out_shape
    self.compute_dtype = jnp.dtype(cfg.dtype)
    # Kernel stored [*out, in] (True, set by `store_out_major`), [in, *out] (False), or [in, *out]
    # and kept so (None).
    self.out_major = False if decode_product else None
    self.kernel = param(rngs, (in_dim, *out_shape), axes, std=cfg.init_std,
                        dtype=cfg.param_dtype)
    self.bias = (param(rngs, out_shape, axes[1:], init="zeros", dtype=cfg.param_dtype)
                 if bias else None)

  def store_out_major(self) -> None:
    w = self.kernel[...]  # [*layers, in, *out]: a stack of scanned layers leads
    self.kernel.value = stored(jnp.moveaxis(w, w.ndim - 1 - len(self.out_shape), -1))
    self.out_major = True

  def __call__(self, x: jax.Array, dtype=None) -> jax.Array:
    """x [..., in] -> [..., *out] in `dtype` (default the compute dtype; fp32 for logits)."""
    w = self.kernel[...].astype(self.compute_dtype)
    x = x.astype(self.compute_dtype)
    if self.out_major:
      y = ops.matmul_out_in(x, w.reshape(-1, w.shape[-1]), dtype)
      y = y.reshape(*x.shape[:-1], *self.out_shape)
    else:
      y = jnp.tensordot(x, w, axes=((x.ndim - 1,), (0,)), preferred_element_type=dtype)
    if self.bias is not None:
      y = y + self.bias[...].astype(y.dtype)
    return y


def stored(kernel: jax.Array) -> jax.Array:
  """A re-laid-out kernel, materialised: folded into the products instead, the transpose would
  undo the layout (and XLA:CPU has no bf16 x bf16 -> fp32 product on a transposed operand)."""
  return jax.lax.optimization_barrier(kernel)


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in fp32 (as HF Llama/Qwen/DeepSeek do)."""

  def __init__(self, dim: int, cfg: ModelConfig, *, rngs: nnx.Rngs, eps: float | None = None,
               axis_name: str = "norm"):
    del rngs
    self.eps = cfg.rms_norm_eps if eps is None else eps
    self.scale = param(None, (dim,), (axis_name,), init="ones", dtype=cfg.param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    dt = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (self.scale[...].astype(jnp.float32) * x32).astype(dt)


class LayerNorm(nnx.Module):
  """Mean/variance LayerNorm with scale and bias (the DSA indexer's key norm)."""

  def __init__(self, dim: int, cfg: ModelConfig, *, rngs: nnx.Rngs, eps: float = 1e-6):
    del rngs
    self.eps = eps
    self.scale = param(None, (dim,), ("norm",), init="ones", dtype=cfg.param_dtype)
    self.bias = param(None, (dim,), ("norm",), init="zeros", dtype=cfg.param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    dt = x.dtype
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(dt)


class Embed(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.compute_dtype = jnp.dtype(cfg.dtype)
    self.embedding = param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"),
                           std=cfg.init_std, dtype=cfg.param_dtype)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.compute_dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """Tied LM head: fp32 logits = x @ E^T (the product accumulated in fp32, not rounded to
    x's dtype first)."""
    return ops.matmul_out_in(x, self.embedding[...].astype(x.dtype), jnp.float32)


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, hidden: int, *, rngs: nnx.Rngs):
    self.gate = Dense(cfg.d_model, hidden, ("embed", "mlp"), cfg, rngs=rngs)
    self.up = Dense(cfg.d_model, hidden, ("embed", "mlp"), cfg, rngs=rngs)
    self.down = Dense(hidden, cfg.d_model, ("mlp", "embed"), cfg, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down(ops.swiglu(x, self.gate, self.up))


# Rotary position embeddings ----------------------------------------------------------------

def rope_frequencies(dim: int, cfg: ModelConfig) -> tuple[jax.Array, float]:
  """Inverse frequencies [dim/2] and the cos/sin magnitude factor (YaRN's mscale ratio)."""
  exponents = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  inv_freq = 1.0 / (cfg.rope_theta**exponents)
  if cfg.llama3_factor > 1.0:
    return _llama3_frequencies(inv_freq, cfg), 1.0
  if cfg.yarn_factor <= 1.0:
    return inv_freq, 1.0
  # YaRN: interpolate low frequencies by `factor`, keep high ones, ramp linearly between the
  # dimensions that complete beta_fast and beta_slow rotations over the original context.
  def correction_dim(num_rotations):
    return (dim * math.log(cfg.yarn_original_max_len / (num_rotations * 2 * math.pi))
            ) / (2 * math.log(cfg.rope_theta))
  low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
  high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), dim - 1)
  if low == high:
    high += 0.001
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
  extrapolation_weight = 1.0 - ramp
  interpolated = inv_freq / cfg.yarn_factor
  inv_freq = interpolated * (1.0 - extrapolation_weight) + inv_freq * extrapolation_weight
  mscale = (yarn_get_mscale(cfg.yarn_factor, cfg.yarn_mscale)
            / yarn_get_mscale(cfg.yarn_factor, cfg.yarn_mscale_all_dim))
  return inv_freq, mscale


def _llama3_frequencies(inv_freq: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Llama 3.x scaling (Meta's `apply_scaling`, HF's rope_type "llama3"): long wavelengths
  (beyond original_max_len / low_freq_factor) slowed by `factor`, short ones (below
  original_max_len / high_freq_factor) kept, the band between interpolated linearly in
  original_max_len / wavelength."""
  factor, low, high = cfg.llama3_factor, cfg.llama3_low_freq_factor, cfg.llama3_high_freq_factor
  old_len = cfg.llama3_original_max_len
  wavelen = 2 * math.pi / inv_freq
  scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
  return jnp.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig, *,
               interleave: bool = False) -> jax.Array:
  """Rotates x [B, T, (H,) D] by positions [B, T].

  Half-split layout pairs dim i with i + D/2 (Llama/Qwen, the DSA indexer). Interleaved layout
  pairs 2i with 2i+1 (DeepSeek MLA checkpoints); its output is returned in the half-split
  order, as HF's DeepSeek-V3 does, which leaves q.k unchanged since q and k get the same order.
  """
  dim = x.shape[-1]
  inv_freq, mscale = rope_frequencies(dim, cfg)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  if x.ndim == 4:
    angles = angles[:, :, None, :]
  cos, sin = jnp.cos(angles) * mscale, jnp.sin(angles) * mscale
  x32 = x.astype(jnp.float32)
  if interleave:
    x1, x2 = x32[..., 0::2], x32[..., 1::2]
  else:
    x1, x2 = x32[..., : dim // 2], x32[..., dim // 2:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
