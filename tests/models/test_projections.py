"""The projection products the rollout engine decodes with on CPU (models/layers.py):
`matmul_out_in` (blocked over the output at few rows, bf16 accumulated in fp32) against one
fp32 einsum; the blocked form is what a CPU decode step traces and not what a TPU program
does; `kernels_out_in` leaves every model's forward unchanged to rounding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels
from models import layers
from models.layers import Dense
from models.transformer import build


def _reference(x, w):
  return np.einsum("...i,oi->...o", np.asarray(x, np.float64), np.asarray(w, np.float64))


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 0.06)])
@pytest.mark.parametrize("lead", [(1,), (3, 1), (8,), (2, 40)])  # 1, 3, 8 and 80 rows
@pytest.mark.parametrize("out", [256, 96])  # blocks of 128; no block divides 96
def test_matmul_out_in_equals_one_einsum(dtype, atol, lead, out):
  """Every path (blocked or not, padded single bf16 row or not) is the same product: within
  fp32 rounding of a float64 einsum, or bf16's output rounding (values ~N(0, 2))."""
  kx, kw = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (*lead, 64)).astype(dtype)
  w = (jax.random.normal(kw, (out, 64)) / 4).astype(dtype)
  y = jax.jit(layers.matmul_out_in)(x, w)
  assert y.shape == (*lead, out) and y.dtype == jnp.dtype(dtype)
  np.testing.assert_allclose(np.asarray(y, np.float64), _reference(x, w), atol=atol,
                             rtol=0.02 if dtype == "bfloat16" else 1e-5)


def _weight_shapes(rows: int) -> list[tuple[int, ...]]:
  """The weight operand's shape in each product `matmul_out_in` traces for `rows` rows."""
  jaxpr = jax.make_jaxpr(lambda x, w: layers.matmul_out_in(x, w))(  # a fresh trace
      jnp.ones((rows, 64)), jnp.ones((256, 64)))
  return [next(tuple(v.aval.shape) for v in e.invars if v.aval.shape[0] != rows)
          for e in jaxpr.eqns if e.primitive.name == "dot_general"]


def test_cpu_decode_rows_take_the_blocked_product_and_tpu_programs_do_not():
  """A decode step on CPU (8 rows) multiplies by [out/128, 128, in] blocks; prefill-sized
  rows and any program traced for TPU keep the single [out, in] product."""
  assert _weight_shapes(8) == [(2, 128, 64)]
  assert _weight_shapes(layers.DECODE_ROWS + 1) == [(256, 64)]
  with kernels.target_platform("tpu"):
    assert _weight_shapes(8) == [(256, 64)]


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_mla"])
def test_kernels_out_in_keeps_the_forward(name):
  """The engine's output-major kernels (every Dense transposed, MLA's absorbed wkv_b read back
  through `in_major`) give the same logits as the stored layout, at 1 row and at 12."""
  graphdef, state = nnx.split(build(name, seed=3))

  @functools.partial(jax.jit, static_argnums=2)
  def logits(state, tokens, out_major):
    model = nnx.merge(graphdef, state)
    if out_major:
      layers.kernels_out_in(model)
      assert all(m.out_major for _, m in model.iter_modules() if isinstance(m, Dense))
    return model.forward(tokens).logits

  for tokens in (jnp.array([[5]]), jnp.arange(1, 13)[None]):
    np.testing.assert_allclose(logits(state, tokens, True), logits(state, tokens, False),
                               atol=2e-5, rtol=0)
