"""The DSA indexer's KL loss (models/dsa.py): values against per-token numpy loops for the dense
warm-up and the sparse stage, where gradients go (only into the indexer; the LM loss gives the
indexer none), the top-k overlap metric, and that a few warm-up steps lower the KL."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels
from models import dsa
from models.attention import MLAttention
from models.config import get_config
from models.transformer import build


@functools.lru_cache(maxsize=None)
def tiny_attention():
  """One DSA attention layer of the tiny preset (top-k 4): an MLAttention with its Indexer."""
  return MLAttention(get_config("tiny_moe_mla_dsa", index_topk=4), rngs=nnx.Rngs(params=2))


def layer_inputs(seed, steps=11, batch=2):
  """Random attention-side inputs of one DSA layer (no cache), with a padded last token."""
  cfg = tiny_attention().cfg
  rng = np.random.default_rng(seed)
  width = cfg.kv_lora_rank + cfg.qk_rope_head_dim

  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)
  token_mask = np.ones((batch, steps), np.float32)
  token_mask[1, -1] = 0.0
  return dict(
      x=normal(batch, steps, cfg.d_model), q_latent=normal(batch, steps, cfg.q_lora_rank),
      positions=jnp.broadcast_to(jnp.arange(steps), (batch, steps)),
      q_full=normal(batch, steps, cfg.n_heads, width), latent=normal(batch, steps, width),
      token_mask=jnp.asarray(token_mask))


def numpy_indexer_scores(indexer, inputs):
  q, k, w = (np.asarray(a, np.float64) for a in indexer.scores_inputs(
      inputs["x"], inputs["q_latent"], inputs["positions"]))
  return np.einsum("bthl,bth->btl", np.maximum(np.einsum("bthd,bld->bthl", q, k), 0.0), w)


def numpy_kl(p, logits):
  p = p / p.sum()
  log_q = logits - logits.max() - np.log(np.sum(np.exp(logits - logits.max())))
  nz = p > 0
  return float(np.sum(p[nz] * (np.log(p[nz]) - log_q[nz])))


def test_kl_matches_numpy():
  """kl_to_indexer is KL(p || softmax(I)) over the valid keys per token (p L1-normalised, zero
  masses allowed); a token without valid keys gives 0."""
  rng = np.random.default_rng(0)
  mass = rng.random((3, 5, 9)) * (rng.random((3, 5, 9)) > 0.3)
  logits = rng.standard_normal((3, 5, 9))
  valid = rng.random((3, 5, 9)) > 0.2
  valid[0, 0] = False
  valid[1, 2] = True
  mass[valid.sum(-1) > 0] += 1e-3 * valid[valid.sum(-1) > 0]
  got = np.asarray(dsa.kl_to_indexer(jnp.asarray(mass), jnp.asarray(logits), jnp.asarray(valid)))
  for b in range(3):
    for t in range(5):
      v = valid[b, t]
      want = numpy_kl(mass[b, t, v], logits[b, t, v]) if v.any() else 0.0
      np.testing.assert_allclose(got[b, t], want, rtol=1e-5, atol=1e-6)


def loss_and_grads(stage, inputs, **extra):
  """Loss, metrics and gradients w.r.t. the indexer's parameters and every input array."""
  attn = tiny_attention()
  graphdef, params = nnx.split(attn.indexer)
  scale = attn.cfg.softmax_scale
  arrays = {k: inputs[k] for k in ("x", "q_latent", "q_full", "latent")}
  arrays.update({k: v for k, v in extra.items() if k == "lse"})
  static = {k: v for k, v in extra.items() if k != "lse"}

  def loss(params, arrays):
    return dsa.indexer_loss(nnx.merge(graphdef, params), stage, positions=inputs["positions"],
                            scale=scale, token_mask=inputs["token_mask"], **arrays, **static)
  (value, metrics), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      params, arrays)
  return value, metrics, grads


def assert_only_indexer_gets_gradient(grads):
  param_grads, input_grads = grads
  leaves = jax.tree.leaves(param_grads)
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0
  for name, g in input_grads.items():
    assert float(jnp.abs(g).max()) == 0.0, name


def test_dense_warmup_loss_matches_numpy_and_trains_only_the_indexer():
  """Dense warm-up: L_I = sum over counted tokens of KL(head-summed dense attention over all
  causal keys || softmax of the indexer score); gradients reach the indexer only."""
  inputs = layer_inputs(1)
  steps = inputs["x"].shape[1]
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((steps, steps), bool)), (2, steps, steps))
  value, metrics, grads = loss_and_grads("dense_warmup", inputs, mask=mask)
  attn = tiny_attention()
  scores = numpy_indexer_scores(attn.indexer, inputs)
  q_full, latent = np.asarray(inputs["q_full"], np.float64), np.asarray(inputs["latent"],
                                                                          np.float64)
  token_mask = np.asarray(inputs["token_mask"])
  want = 0.0
  for b in range(2):
    for t in range(steps):
      if token_mask[b, t] == 0:
        continue
      logits = np.einsum("hc,sc->hs", q_full[b, t], latent[b, : t + 1]) * attn.cfg.softmax_scale
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      target = (probs / probs.sum(-1, keepdims=True)).sum(0)
      want += numpy_kl(target, scores[b, t, : t + 1])
  np.testing.assert_allclose(float(value), want, rtol=1e-4)
  np.testing.assert_allclose(float(metrics["indexer_kl"]), want / (2 * steps - 1), rtol=1e-4)
  assert 0.0 <= float(metrics["indexer_topk_overlap"]) <= 1.0
  assert_only_indexer_gets_gradient(grads)


def test_sparse_stage_restricts_to_the_selection():
  """Sparse stage: both distributions live on the indexer's top-k set, the target comes from
  the lse of the interpret-mode sparse_mla kernel (selection by the indexer kernel), and
  gradients reach the indexer only (its inputs, the attention and the lse are detached)."""
  backend = "interpret"
  inputs = layer_inputs(2)
  attn = tiny_attention()
  scale = attn.cfg.softmax_scale
  indices, _, _ = attn.indexer(inputs["x"], inputs["q_latent"], inputs["positions"],
                               kernel_backend=backend)
  _, lse = kernels.sparse_mla(inputs["q_full"], inputs["latent"], indices, scale=scale,
                              d_v=attn.cfg.kv_lora_rank, backend=backend)
  value, _, grads = loss_and_grads("sparse", inputs, indices=indices, lse=lse)
  scores = numpy_indexer_scores(attn.indexer, inputs)
  q_full, latent = np.asarray(inputs["q_full"], np.float64), np.asarray(inputs["latent"],
                                                                          np.float64)
  token_mask = np.asarray(inputs["token_mask"])
  idx = np.asarray(indices)
  want = 0.0
  for b in range(2):
    for t in range(idx.shape[1]):
      if token_mask[b, t] == 0:
        continue
      sel = idx[b, t][idx[b, t] >= 0]
      logits = np.einsum("hc,kc->hk", q_full[b, t], latent[b, sel]) * scale
      probs = np.exp(logits - logits.max(-1, keepdims=True))
      target = (probs / probs.sum(-1, keepdims=True)).sum(0)
      want += numpy_kl(target, scores[b, t, sel])
  np.testing.assert_allclose(float(value), want, rtol=1e-4)
  assert_only_indexer_gets_gradient(grads)


def test_lm_loss_passes_no_gradient_to_the_indexer():
  """With top-k < sequence length and the interpret-mode kernels, a next-token loss of the
  whole model gives every indexer parameter exactly zero gradient (the selection is discrete)
  while the attention weights do get one: the model trains only on its own loss."""
  model = build("tiny_moe_mla_dsa", seed=3, index_topk=4, n_layers=1)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = jax.random.randint(jax.random.key(0), (2, 12), 1, 200)

  def loss(params):
    logits = nnx.merge(graphdef, params, rest).forward(tokens[:, :-1],
                                                       kernel_backend="interpret").logits
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
  grads = jax.jit(jax.grad(loss))(params)
  for stack in (grads["stacks"][g] for g in range(len(model.cfg.layer_stacks))):  # [layers, ...]
    attn = stack["attn"]
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(attn["indexer"]))
    assert jnp.all(jnp.abs(attn["wkv_a"]["kernel"][...]).sum(axis=(1, 2)) > 0)


def test_topk_overlap_counts():
  """Overlap = shared top-k keys / min(k, valid keys): 1 for the same ranking, 0 for disjoint
  top-k, partial counts, and tokens with fewer valid keys than k."""
  target = jnp.array([[[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]])
  valid = jnp.ones((1, 1, 6), bool)
  same = dsa.topk_overlap(target, target * 2.0, valid, 2)
  disjoint = dsa.topk_overlap(target, -target, valid, 2)
  half = dsa.topk_overlap(target, jnp.array([[[5.0, 0.0, 9.0, 0.0, 0.0, 0.0]]]), valid, 2)
  few = dsa.topk_overlap(target, -target, valid.at[..., 2:].set(False), 4)
  np.testing.assert_allclose([float(same[0, 0]), float(disjoint[0, 0]), float(half[0, 0]),
                              float(few[0, 0])], [1.0, 0.0, 0.5, 1.0])


def test_stage_is_checked():
  """An unknown stage, or a stage without the inputs it needs, fails naming the problem."""
  inputs = layer_inputs(3)
  kwargs = dict(x=inputs["x"], q_latent=inputs["q_latent"], positions=inputs["positions"],
                q_full=inputs["q_full"], latent=inputs["latent"], scale=0.1)
  with pytest.raises(ValueError, match="must be one of"):
    dsa.indexer_loss(tiny_attention().indexer, "warmup", **kwargs)
  with pytest.raises(ValueError, match="attention mask"):
    dsa.indexer_loss(tiny_attention().indexer, "dense_warmup", **kwargs)
  with pytest.raises(ValueError, match="lse"):
    dsa.indexer_loss(tiny_attention().indexer, "sparse", **kwargs)


def test_dense_warmup_steps_lower_the_kl():
  """Thirty gradient steps (SGD, lr 1 on the per-token mean) on the indexer alone (dense
  warm-up, fixed batch) at least halve its KL to the dense attention."""
  inputs = layer_inputs(4)
  steps = inputs["x"].shape[1]
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((steps, steps), bool)), (2, steps, steps))
  attn = tiny_attention()
  graphdef, params = nnx.split(attn.indexer)
  fixed = {k: v for k, v in inputs.items() if k != "token_mask"}

  @jax.jit
  def step(params):
    def loss(params):
      return dsa.indexer_loss(nnx.merge(graphdef, params), "dense_warmup", mask=mask,
                              scale=attn.cfg.softmax_scale, **fixed)[0] / (2 * steps)
    value, grads = jax.value_and_grad(loss)(params)
    return value, jax.tree.map(lambda p, g: p - 1.0 * g, params, grads)

  first, params = step(params)
  for _ in range(29):
    last, params = step(params)
  assert float(last) < 0.5 * float(first), (float(first), float(last))
