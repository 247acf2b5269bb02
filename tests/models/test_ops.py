"""The host-specific ops (models/ops.py) and their CPU bodies (models/ops_cpu.py): each CPU body
computes its portable op's function, to rounding, and only CPU programs trace it.

Projections: `matmul_out_in` (blocked over the output at few rows, bf16 accumulated in fp32)
against one float64 einsum; the blocked form is what a CPU decode step traces and not what a TPU
program does; `sampler_layout` leaves every model's forward unchanged to rounding and its inputs
as they were. SwiGLU: the fp32-accumulated CPU form against the portable one. Attention: the
one-query-row multiply-and-reduce against the float64 softmax and the dot path, over the
head-major KV cache `write_slots` fills. The model files ask no platform question."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pathlib
import re

import kernels
from models import ops, ops_cpu
from models.attention import OutProj
from models.config import get_config
from models.layers import MLP, Dense
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
  y = jax.jit(ops.matmul_out_in)(x, w)
  assert y.shape == (*lead, out) and y.dtype == jnp.dtype(dtype)
  np.testing.assert_allclose(np.asarray(y, np.float64), _reference(x, w), atol=atol,
                             rtol=0.02 if dtype == "bfloat16" else 1e-5)


def _weight_shapes(rows: int, dtype=jnp.float32) -> list[tuple[int, ...]]:
  """The weight operand's shape in each product `matmul_out_in` traces for `rows` rows."""
  jaxpr = jax.make_jaxpr(lambda x, w: ops.matmul_out_in(x, w))(  # a fresh trace
      jnp.ones((rows, 64), dtype), jnp.ones((256, 64), dtype))
  return [next(tuple(v.aval.shape) for v in e.invars if v.aval.shape[0] != rows)
          for e in jaxpr.eqns if e.primitive.name == "dot_general"]


def test_cpu_decode_rows_take_the_blocked_product_and_tpu_programs_do_not():
  """A decode step on CPU (8 rows) multiplies by [out/128, 128, in] blocks, to 64 fp32 rows
  and 16 bf16 rows; prefill-sized rows and any program traced for TPU keep the single
  [out, in] product."""
  for dtype, most in ((jnp.float32, 64), (jnp.bfloat16, 16)):
    assert ops_cpu.DECODE_ROWS[jnp.dtype(dtype).itemsize] == most
    assert _weight_shapes(8, dtype) == _weight_shapes(most, dtype) == [(2, 128, 64)]
    assert _weight_shapes(most + 1, dtype) == [(256, 64)]
  with kernels.target_platform("tpu"):
    assert _weight_shapes(8) == [(256, 64)]


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_mla"])
def test_sampler_layout_keeps_the_forward_and_its_inputs(name):
  """The engine's CPU layout (layers unstacked, every Dense and attention output projection
  stored output-major, MLA's absorbed wkv_b left [in, *out]) gives the same logits as the
  stored layout, at 1 row and at 12, and leaves the (graphdef, state) it was given as it was."""
  graphdef, state = nnx.split(build(name, seed=3))
  before = jax.tree.map(np.asarray, state)

  @functools.partial(jax.jit, static_argnums=2)
  def logits(state, tokens, relayout):
    model = nnx.merge(*ops.sampler_layout(graphdef, state)) if relayout else nnx.merge(
        graphdef, state)
    if relayout:
      projections = [m for _, m in model.iter_modules() if isinstance(m, (Dense, OutProj))]
      assert all(m.out_major is not False for m in projections)
      assert sum(m.out_major is None for m in projections) == (
          model.cfg.n_layers if model.cfg.attention == "mla" else 0)  # each layer's wkv_b
    return model.forward(tokens).logits

  for tokens in (jnp.array([[5]]), jnp.arange(1, 13)[None]):
    np.testing.assert_allclose(logits(state, tokens, True), logits(state, tokens, False),
                               atol=2e-5, rtol=0)
  new_graphdef, new_state = ops.sampler_layout(graphdef, state)  # outside jit: nothing shared
  assert new_graphdef != graphdef
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state), before)
  with kernels.target_platform("tpu"):
    assert ops.sampler_layout(graphdef, state) == (graphdef, state)


@pytest.mark.parametrize("dtype,atol", [("float32", 1e-6), ("bfloat16", 0.02)])
def test_swiglu_on_cpu_equals_the_portable_form(dtype, atol):
  """The MLP's CPU SwiGLU (gate and up kept in fp32, rounded once) equals the portable form
  (each rounded to the compute dtype first) to the compute dtype's rounding."""
  cfg = get_config("tiny_dense", dtype=dtype)
  mlp = MLP(cfg, 64, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 5, cfg.d_model)).astype(dtype)
  fused = ops.swiglu(x, mlp.gate, mlp.up)
  with kernels.target_platform("gpu"):
    portable = ops.swiglu(x, mlp.gate, mlp.up)
  assert fused.dtype == portable.dtype == jnp.dtype(dtype)
  np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(portable, np.float32),
                             atol=atol, rtol=0.02 if dtype == "bfloat16" else 1e-6)


def test_the_model_files_ask_no_platform_question():
  """Host-specific compute goes through models/ops.py: the layer files hold no platform check."""
  root = pathlib.Path(__file__).resolve().parents[2] / "models"
  for name in ("attention.py", "layers.py", "moe.py", "moe_ep.py", "cache.py", "transformer.py",
               "dsa.py"):
    text = (root / name).read_text()
    assert not re.search(r"platform\(\)|default_backend\(\)|ops_cpu", text), name


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
  fused = ops.grouped_attention(q, k, v, mask, 0.25)
  with kernels.target_platform("tpu"):  # the traced dot path, run here on CPU
    dotted = ops.grouped_attention(q, k, v, mask, 0.25)
  jaxpr = str(jax.make_jaxpr(lambda *a: ops.grouped_attention(*a, 0.25))(q, k, v, mask))
  assert "dot_general" not in jaxpr
  want = _attention_reference(q, k, v, mask, 0.25)
  np.testing.assert_allclose(np.asarray(fused, np.float64), want, atol=atol)
  np.testing.assert_allclose(np.asarray(dotted, np.float64), want, atol=atol)


@pytest.mark.parametrize("dtype,steps", [("bfloat16", 1), ("float32", 1), ("float32", 3)])
def test_write_slots_fills_head_major_slots(dtype, steps):
  """`write_slots` puts token-major rows [B, T, KVH, D] at slots start[b] + t of a head-major
  cache [B, KVH, S, D] (the bf16 one-token CPU select and the scatter alike) and drops what
  falls past the end."""
  rng = np.random.default_rng(1)
  buf = jnp.asarray(rng.normal(size=(3, 2, 6, 4)), dtype)
  new = jnp.asarray(rng.normal(size=(3, steps, 2, 4)), dtype)
  start = np.array([0, 4, 5])
  out = np.asarray(ops.write_slots(buf, new, jnp.asarray(start)), np.float32)
  want = np.asarray(buf, np.float32).copy()
  for b in range(3):
    for t in range(steps):
      if start[b] + t < 6:
        want[b, :, start[b] + t] = np.asarray(new, np.float32)[b, t]
  np.testing.assert_array_equal(out, want)
