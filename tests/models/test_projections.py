"""The products the rollout engine decodes with on CPU. Projections (models/layers.py):
`matmul_out_in` (blocked over the output at few rows, bf16 accumulated in fp32) against one
fp32 einsum; the blocked form is what a CPU decode step traces and not what a TPU program
does; `kernels_out_in` leaves every model's forward unchanged to rounding. Attention
(models/attention.py, models/cache.py): the one-query-row multiply-and-reduce against the
float64 softmax and the dot path, over the head-major KV cache `cache.write` fills."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels
from models import cache as cache_lib
from models import layers
from models.attention import OutProj, grouped_attention
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
  """The engine's output-major kernels (every Dense and attention output projection transposed,
  MLA's absorbed wkv_b read back through `in_major`) give the same logits as the stored
  layout, at 1 row and at 12."""
  graphdef, state = nnx.split(build(name, seed=3))

  @functools.partial(jax.jit, static_argnums=2)
  def logits(state, tokens, out_major):
    model = nnx.merge(graphdef, state)
    if out_major:
      layers.kernels_out_in(model)
      assert all(m.out_major for _, m in model.iter_modules() if isinstance(m, (Dense, OutProj)))
    return model.forward(tokens).logits

  for tokens in (jnp.array([[5]]), jnp.arange(1, 13)[None]):
    np.testing.assert_allclose(logits(state, tokens, True), logits(state, tokens, False),
                               atol=2e-5, rtol=0)


def _attention_reference(q, k, v, mask, scale):
  """float64 GQA: q [B,T,H,D], head-major k / v [B,KVH,S,D], mask [B,T,S]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  group = q.shape[2] // k.shape[1]
  k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
  logits = np.einsum("bthd,bhsd->bhts", q, k) * scale
  logits = np.where(np.asarray(mask)[:, None], logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum("bhts,bhsd->bthd", probs, v)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-5), ("bfloat16", 0.03)])
def test_decode_attention_matches_float64_and_the_dot_path(dtype, atol):
  """One query row (a decode step) on CPU takes the fused multiply-and-reduce; it equals the
  float64 softmax attention and the dot path that prefill and TPU programs take, with rows
  filled to different lengths (masked slots must not count)."""
  rng = np.random.default_rng(0)
  batch, heads, kv_heads, slots, dim = 3, 6, 2, 40, 16
  q = jnp.asarray(rng.normal(size=(batch, 1, heads, dim)), dtype)
  k = jnp.asarray(rng.normal(size=(batch, kv_heads, slots, dim)), dtype)
  v = jnp.asarray(rng.normal(size=(batch, kv_heads, slots, dim)), dtype)
  mask = jnp.arange(slots)[None, None, :] < jnp.array([1, 17, 40])[:, None, None]
  fused = grouped_attention(q, k, v, mask, 0.25)
  with kernels.target_platform("tpu"):  # the traced dot path, run here on CPU
    dotted = grouped_attention(q, k, v, mask, 0.25)
  jaxpr = str(jax.make_jaxpr(lambda *a: grouped_attention(*a, 0.25))(q, k, v, mask))
  assert "dot_general" not in jaxpr
  want = _attention_reference(q, k, v, mask, 0.25)
  np.testing.assert_allclose(np.asarray(fused, np.float64), want, atol=atol)
  np.testing.assert_allclose(np.asarray(dotted, np.float64), want, atol=atol)


@pytest.mark.parametrize("dtype,steps", [("bfloat16", 1), ("float32", 1), ("float32", 3)])
def test_cache_write_fills_head_major_slots(dtype, steps):
  """`cache.write` puts token-major rows [B, T, KVH, D] at slots start[b] + t of a head-major
  cache [B, KVH, S, D] (the bf16 one-token CPU select and the scatter alike) and drops what
  falls past the end."""
  rng = np.random.default_rng(1)
  buf = jnp.asarray(rng.normal(size=(3, 2, 6, 4)), dtype)
  new = jnp.asarray(rng.normal(size=(3, steps, 2, 4)), dtype)
  start = np.array([0, 4, 5])
  out = np.asarray(cache_lib.write(buf, new, jnp.asarray(start)), np.float32)
  want = np.asarray(buf, np.float32).copy()
  for b in range(3):
    for t in range(steps):
      if start[b] + t < 6:
        want[b, :, start[b] + t] = np.asarray(new, np.float32)[b, t]
  np.testing.assert_array_equal(out, want)
