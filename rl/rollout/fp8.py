"""FP8 post-training quantisation of the policy weights for the rollout sampler.

The trainer keeps training in its own precision; after every weight update the sampler gets a
copy of the big matmul weights in float8_e4m3fn plus fp32 scales (`SamplerWeights`), and the
rollout engine dequantises them inside its jit (`dequantize_state`, called by rl/rollout/engine.py
before it merges the model). The importance ratio uses the sampler's own log-probs
(`Trajectories.logp_old`), so the precision gap is off-policyness that the clipped objective
and off-policy masking already cover; `logp_gap` measures it.

What is quantised (`quantize_state`): every 2-D-or-larger `nnx.Param` (attention projections,
dense and shared MLPs, routed-expert weights) except those under a module named in
`HIGH_PRECISION_MODULES`:
- "embed" and "head": the token embedding is a lookup (no matmul to speed up) and the LM head
  writes the logits directly, so its error lands on every sampled token's probability
  (DeepSeek-V3's FP8 recipe keeps both in high precision as well);
- "router": expert choice is a top-k over router scores, a discrete decision that a small
  weight error can flip; the router is tiny ([d_model, n_experts]);
- "indexer": the DSA lightning indexer picks the top-k keys every MLA head attends to, another
  discrete selection, from small weights.
Norm scales, biases and router biases are 1-D and stay as they are.

Scales: one per output channel and per block of `block_size` inputs along the contraction
axis (0 = the whole axis: per output channel). The contraction axis comes from the parameter's
logical axes (`quantize_param`): axis 0 of a [in, *out] kernel (every output index, heads
included, gets its own scales), axis 1 of expert weights [experts, in, out], and heads x
head_dim of an output projection [heads, head_dim, out].

Error-compensated range: plain absmax maps a block's largest value to the e4m3 maximum (448).
For a floating-point format that is rarely the best range: the relative step is the same in
every binade, so what decides the error is where the block's few largest values fall between
grid points, and clipping them (the usual int8 remedy) only adds error. So, per block, the
range is chosen among absmax * 2^(k/16) for k in `RANGE_EXPONENTS` (-4: mild clipping, up to
15: a range almost one binade wider, so every alignment of the grid is tried); each
candidate's scale is then refitted by least squares for its rounded codes (s* = <w, c> /
<c, c>, the error compensation: the rounding errors of the big values no longer bias the
scale), and the candidate with the smallest squared error wins. absmax is candidate k = 0
before its refit, so the result is never worse than absmax; measured gains in
tests/rl/rollout/test_quant.py.

Memory: the sampler's copy of the quantised weights takes a byte per value (plus the
scales) where bf16 takes two and fp32 four, which is what moves when weights are sent to a
separate rollout slice. Inside the engine the weights are dequantised once per call, before
its decode loop, and the matmuls run in the model's compute dtype: the engine's peak still
holds a full-precision copy and decoding reads it, so this is not yet an FP8-matmul speed-up.
With the sampler on the trainer's own devices the FP8 copy is extra memory (the unquantised
sampler state is the trainer's arrays themselves).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rl.core.checks import allowed

WEIGHT_DTYPES = ("", "fp8_e4m3")  # config.rollout.weight_dtype: "" = the trainer's weights
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
RANGE_EXPONENTS = tuple(k / 16 for k in range(-4, 16))
HIGH_PRECISION_MODULES = ("embed", "head", "router", "indexer")


@functools.partial(jax.tree_util.register_dataclass, data_fields=("codes", "scale"),
                   meta_fields=("axis", "block_size", "dtype", "weight_shape"))
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """A weight as fp8 codes and fp32 scales (the codes' shape with the contraction axis cut to
  its number of blocks); weight ~= (codes * scale, block-wise).reshape(weight_shape)."""

  codes: jax.Array
  scale: jax.Array
  axis: int  # the contraction axis the blocks run along
  block_size: int  # inputs per scale along `axis`
  dtype: str  # the original weight's dtype, restored by `dequantize`
  weight_shape: tuple[int, ...]  # the weight's (codes may be a flattened 2-D view of it)

  @property
  def nbytes(self) -> int:
    return self.codes.size * self.codes.dtype.itemsize + self.scale.size * 4


def _blocked(x: jax.Array, axis: int, block: int) -> jax.Array:
  """[..., n, ...] -> [..., ceil(n / block), block, ...], zero-padded along `axis`."""
  n = x.shape[axis]
  blocks = -(-n // block)
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, blocks * block - n)
  x = jnp.pad(x, widths)
  return x.reshape(x.shape[:axis] + (blocks, block) + x.shape[axis + 1:])


def _to_fp8(x: jax.Array) -> jax.Array:
  # Out-of-range values would become NaN in e4m3fn (it has no infinity): saturate instead.
  return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


@functools.partial(jax.jit, static_argnames=("axis", "block_size", "range_search"))
def quantize(w: jax.Array, *, axis: int = 0, block_size: int = 0,
             range_search: bool = True) -> QuantizedWeight:
  """Quantises w to fp8 codes with one scale per output channel and block along `axis`.

  range_search=False is plain absmax scaling (the comparison point); True picks each block's
  range among `RANGE_EXPONENTS` with a least-squares scale refit (module docstring).
  """
  axis = axis % w.ndim
  n = w.shape[axis]
  block = min(block_size, n) if block_size > 0 else n
  x = _blocked(w.astype(jnp.float32), axis, block)
  inner = axis + 1  # the within-block axis of the blocked view

  def sum_in_block(v):
    return jnp.sum(v, axis=inner, keepdims=True)

  absmax = jnp.max(jnp.abs(x), axis=inner, keepdims=True)
  base = jnp.where(absmax > 0, absmax / FP8_MAX, 1.0)
  if not range_search:
    codes, scale = _to_fp8(x / base), base
  else:
    def candidate(exponent):
      """(squared error, codes, refitted scale) of the range absmax * 2^exponent."""
      trial = base * 2.0**exponent
      trial_codes = _to_fp8(x / trial)
      c = trial_codes.astype(jnp.float32)
      norm = sum_in_block(c * c)
      fitted = jnp.where(norm > 0, sum_in_block(x * c) / jnp.where(norm > 0, norm, 1.0), trial)
      return sum_in_block(jnp.square(c * fitted - x)), trial_codes, fitted

    def keep_better(k, best):
      trial = candidate(exponents[k])
      better = trial[0] < best[0]
      return tuple(jnp.where(better, new, old) for new, old in zip(trial, best))

    # A loop, not an unrolled Python loop: one candidate's temporaries at a time and a
    # small program to compile.
    exponents = jnp.asarray(RANGE_EXPONENTS, jnp.float32)
    _, codes, scale = jax.lax.fori_loop(0, len(RANGE_EXPONENTS), keep_better, candidate(0.0))
  codes = codes.reshape(codes.shape[:axis] + (-1,) + codes.shape[inner + 1:])
  codes = jax.lax.slice_in_dim(codes, 0, n, axis=axis)
  return QuantizedWeight(codes=codes, scale=jnp.squeeze(scale, inner).astype(jnp.float32),
                         axis=axis, block_size=block, dtype=jnp.dtype(w.dtype).name,
                         weight_shape=tuple(w.shape))


def dequantize(q: QuantizedWeight) -> jax.Array:
  """codes * scale in the original dtype (the scales repeated over their blocks)."""
  n = q.codes.shape[q.axis]
  scale = jax.lax.slice_in_dim(jnp.repeat(q.scale, q.block_size, axis=q.axis), 0, n,
                               axis=q.axis)
  return (q.codes.astype(jnp.float32) * scale).astype(q.dtype).reshape(q.weight_shape)


# ------------------------------------------------------------------------------ model states

def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def _module_names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def quantize_param(variable: nnx.Variable, *, block_size: int = 0) -> QuantizedWeight:
  """Quantises a kernel along its contraction axis, read from its logical axes: axis 1 of
  expert weights [experts, in, out]; heads x head_dim of an output projection [heads,
  head_dim, out] (quantised as [heads * head_dim, out]); axis 0 of every [in, *out] kernel."""
  w = variable.get_value()
  axes = tuple(variable.get_metadata().get("logical_axes") or ())
  lead = _stacked_axes(variable)  # a stack of scanned layers: one scale set per layer
  if axes[lead:lead + 1] == ("experts",):
    return quantize(w, axis=lead + 1, block_size=block_size)
  if axes[lead:lead + 1] == ("heads",):
    flat = quantize(w.reshape(*w.shape[:lead], -1, w.shape[-1]), axis=lead,
                    block_size=block_size)
    return dataclasses.replace(flat, weight_shape=tuple(w.shape))
  return quantize(w, axis=lead, block_size=block_size)


def _stacked_axes(variable: nnx.Variable) -> int:
  """How many leading axes of the variable stack layers (models/transformer.py)."""
  axes = tuple(variable.get_metadata().get("logical_axes") or ())
  return len(axes) - len(tuple(a for a in axes if a != "layers"))


def quantizable(path, variable) -> bool:
  """Whether the sampler holds this state entry in FP8 (module docstring: which and why)."""
  return (isinstance(variable, nnx.Param)
          and jnp.ndim(variable.get_value()) - _stacked_axes(variable) >= 2
          and not set(_module_names(path)) & set(HIGH_PRECISION_MODULES))


def quantize_state(state: nnx.State, *, block_size: int = 0) -> nnx.State:
  """The model state with every `quantizable` weight replaced by a `QuantizedWeight`; the
  rest are the same arrays. One jitted `quantize` per weight: compilations scale with the
  distinct weight shapes (a layer's worth), not with the depth of the model."""
  def one(path, variable):
    if not quantizable(path, variable):
      return variable
    return variable.replace(quantize_param(variable, block_size=block_size))
  return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def dequantize_state(state):
  """Any state (pytree) with its `QuantizedWeight`s dequantised; identity without any. Runs
  inside the rollout engine's jit, so only the fp8 codes and scales cross its boundary."""
  return jax.tree.map(lambda x: dequantize(x) if isinstance(x, QuantizedWeight) else x, state,
                      is_leaf=lambda x: isinstance(x, QuantizedWeight))


def state_nbytes(state) -> int:
  """Bytes the state's arrays occupy (fp8 codes count one byte, their scales four)."""
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantizedWeight))
  return sum(x.nbytes if isinstance(x, QuantizedWeight) else x.size * x.dtype.itemsize
             for x in leaves)


def check_sampler_weights(rollout: Any) -> None:
  """config.rollout's sampler-weight fields, as the trainer passes them to `SamplerWeights`."""
  allowed("rollout.weight_dtype", rollout.weight_dtype, WEIGHT_DTYPES)
  if rollout.weight_block_size < 0:
    raise ValueError(f"config.rollout.weight_block_size={rollout.weight_block_size}: must be "
                     ">= 0 (0: one scale per output channel)")


class SamplerWeights:
  """The sampler's state for `weight_dtype`, quantised again only when the trainer's
  parameters changed (new arrays after an update, a restore or a re-initialisation)."""

  def __init__(self, weight_dtype: str, *, block_size: int = 0):
    if weight_dtype not in WEIGHT_DTYPES or not weight_dtype:
      raise ValueError(f"weight_dtype={weight_dtype!r}: must be one of {list(WEIGHT_DTYPES[1:])}")
    self.block_size = block_size
    self._sources: tuple = ()
    self._state = None

  def __call__(self, params: nnx.State, rest: nnx.State) -> nnx.State:
    leaves = jax.tree.leaves(params) + jax.tree.leaves(rest)
    if len(self._sources) != len(leaves) or any(ref() is not leaf
                                               for ref, leaf in zip(self._sources, leaves)):
      self._state = quantize_state(nnx.merge_state(params, rest), block_size=self.block_size)
      self._sources = tuple(weakref.ref(leaf) for leaf in leaves)
    return self._state


def logp_gap(logp_trainer, logp_sampler, response_mask) -> dict[str, float]:
  """Mean and max |logp_trainer - logp_sampler| over response tokens ([B, T] each)."""
  mask = np.asarray(response_mask) > 0
  diff = np.abs(np.asarray(logp_trainer, np.float64) - np.asarray(logp_sampler, np.float64))
  diff = diff[mask]
  if diff.size == 0:
    return {"sampler/logp_gap_mean": 0.0, "sampler/logp_gap_max": 0.0}
  return {"sampler/logp_gap_mean": float(diff.mean()), "sampler/logp_gap_max": float(diff.max())}
