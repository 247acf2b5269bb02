"""The optimiser on float32 master weights (rl/core/train_step.py fp32_master)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl.core import train_step as ts


def _run(params, optimizer, steps=100):
  state = optimizer.init(params)
  grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.3, p.dtype), params)
  for _ in range(steps):
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_master_weights_keep_lr_sized_steps_of_bf16_parameters():
  """bf16 weights near 0.01 under AdamW at lr 1e-6 (the DeepSeek-V3.2 recipe's): without a
  master copy every step is below half an ulp and the weights never move; with fp32 master
  weights the master equals a float32 run exactly and the bf16 weights are it rounded, having
  moved by ~100 steps x lr (over an ulp, 6.1e-5, at 0.0123)."""
  start = {"w": jnp.full((4, 8), 0.0123, jnp.float32)}
  kw = dict(lr=1e-6, warmup_steps=None, weight_decay=0.0, grad_clip=1e9)
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), start)
  plain, _ = _run(bf16, ts.make_optimizer(**kw))
  np.testing.assert_array_equal(plain["w"], bf16["w"])  # every step rounded away

  reference, _ = _run(jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), start),
                      ts.make_optimizer(**kw))
  kept, state = _run(bf16, ts.make_optimizer(**kw, master_weights=True))
  assert kept["w"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(state.master["w"], reference["w"])
  np.testing.assert_array_equal(kept["w"], reference["w"].astype(jnp.bfloat16))
  moved = float(bf16["w"][0, 0]) - float(state.master["w"][0, 0])
  np.testing.assert_allclose(moved, 100 * 1e-6, rtol=0.05)
  assert float(kept["w"][0, 0]) != float(bf16["w"][0, 0])  # the bf16 weight shows it


def test_master_weights_on_float32_parameters_change_nothing():
  """On float32 parameters the wrapped optimiser gives exactly the plain optimiser's weights."""
  params = {"w": jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)}
  kw = dict(lr=1e-2, warmup_steps=2, weight_decay=0.1, grad_clip=1.0)
  plain, _ = _run(params, ts.make_optimizer(**kw), steps=5)
  kept, _ = _run(params, ts.make_optimizer(**kw, master_weights=True), steps=5)
  np.testing.assert_array_equal(kept["w"], plain["w"])
