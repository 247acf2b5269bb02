"""The dropless expert dispatches against the one-hot dense reference: `ragged_experts`
(ragged_dot: TPU / GPU) and `cpu_experts` (each of its three forms), outputs and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import moe

DIM, HIDDEN, N_EXPERTS, TOP_K = 16, 12, 16, 2


def _problem(n, seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  x = jax.random.normal(keys[0], (n, DIM))
  logits = jax.random.normal(keys[1], (n, N_EXPERTS)) - 0.3 * jnp.arange(N_EXPERTS)
  ids = jax.lax.top_k(logits, TOP_K)[1].astype(jnp.int32)
  weights = jax.random.uniform(keys[2], (n, TOP_K))
  w_gate = 0.3 * jax.random.normal(keys[3], (N_EXPERTS, DIM, HIDDEN))
  w_up = 0.3 * jax.random.normal(keys[4], (N_EXPERTS, DIM, HIDDEN))
  w_down = 0.3 * jax.random.normal(keys[5], (N_EXPERTS, HIDDEN, DIM))
  return x, ids, weights, w_gate, w_up, w_down


def _loss(experts, *args):
  return jnp.sum(jnp.sin(experts(*args)))


# 1 token: its 2 experts are an eighth of 16 (gathered); 8 and 64: every expert at once; 130:
# three chunks of 64, the last padded.
@pytest.mark.parametrize("n", [1, 8, 64, 130])
@pytest.mark.parametrize("experts", [moe.cpu_experts, moe.ragged_experts],
                         ids=["cpu_experts", "ragged_experts"])
def test_dispatch_equals_dense_reference(experts, n):
  """Output and gradients (x, gate weights, every expert weight) equal dense_experts' to fp32
  rounding (relative 1e-5)."""
  args = _problem(n)
  want = np.asarray(moe.dense_experts(*args))
  np.testing.assert_allclose(np.asarray(jax.jit(experts)(*args)), want, rtol=1e-5,
                             atol=1e-5 * np.abs(want).max())
  wrt = (0, 2, 3, 4, 5)
  grads = jax.jit(jax.grad(functools.partial(_loss, experts), argnums=wrt))(*args)
  ref = jax.grad(functools.partial(_loss, moe.dense_experts), argnums=wrt)(*args)
  for g, r in zip(grads, ref):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5,
                               atol=1e-5 * np.abs(np.asarray(r)).max())
