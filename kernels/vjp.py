"""What every sparse-MLA kernel shares: the check of a call's operands and launch parameters,
and the differentiable wrapper joining a forward kernel returning (out, lse) and a backward kernel
returning (dq, dkv) by `jax.custom_vjp`."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax

from kernels import autotune


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static parameters every sparse-MLA kernel call has (hashable: the nondiff argument of the
  custom_vjp); each kernel's subclass adds its own."""
  scale: float
  d_v: int
  block_h: int
  block_k: int


def launch_params(q: jax.Array, kv: jax.Array, d_v: int, block_config: str,
                  tuned: Callable[[], dict], **given) -> dict:
  """The launch parameters of one call: `given` (block_config "default") or those of them the
  autotuned choice `tuned()` holds ("auto"), after checking that q [.., D] and kv [.., D] share
  the latent + rope width D and that d_v leaves a rope part (0 < d_v < D)."""
  dim = q.shape[-1]
  if kv.shape[-1] != dim or not 0 < d_v < dim:
    raise ValueError(f"sparse_mla: q width {dim}, kv width {kv.shape[-1]}, d_v {d_v}: kv must "
                     "match q and d_v must leave a rope part")
  autotune.check_block_config(block_config)
  if block_config == "auto":
    choice = tuned()
    given = {name: choice.get(name, value) for name, value in given.items()}
  return given


def attention_with_vjp(forward: Callable, backward: Callable) -> Callable:
  """`attend(q, kv, indices, tiling) -> (out, lse)` differentiable in q and kv.

  forward(q, kv, indices, tiling) -> (out, lse);
  backward(q, kv, indices, out, lse, dout, dlse, tiling) -> (dq, dkv) (any float dtype; cast
  back to the inputs' dtypes here). `tiling` is static (hashable).
  """
  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def attend(q, kv, indices, tiling):
    return forward(q, kv, indices, tiling)

  def attend_fwd(q, kv, indices, tiling):
    out, lse = forward(q, kv, indices, tiling)
    return (out, lse), (q, kv, indices, out, lse)

  def attend_bwd(tiling, residuals, cotangents):
    q, kv, indices, out, lse = residuals
    dq, dkv = backward(q, kv, indices, out, lse, *cotangents, tiling)
    return dq.astype(q.dtype), dkv.astype(kv.dtype), None

  attend.defvjp(attend_fwd, attend_bwd)
  return attend
