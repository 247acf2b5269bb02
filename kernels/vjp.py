"""The differentiable wrapper every sparse-MLA kernel shares: a forward kernel returning
(out, lse) and a backward kernel returning (dq, dkv), joined by `jax.custom_vjp`."""

from __future__ import annotations

import functools
from typing import Callable

import jax


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
