"""Model tests: cache vs full forward, causality, DSA vs dense MLA and a naive loop, MoE
dispatch paths and routing replay, gradients, parameter counts and config errors."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import ops
from models.attention import ATTENTION
from models.config import ATTENTION_KINDS, PRESETS, PUBLISHED_PARAMS, ModelConfig, get_config
from models.moe import aux_free_bias_update
from models.transformer import build, param_counts

TINY = ["tiny_dense", "tiny_qwen3_moe", "tiny_mla", "tiny_moe_mla_dsa"]


@functools.lru_cache(maxsize=None)
def tiny_model(name, **overrides):
  return build(name, seed=1, **overrides)


@functools.lru_cache(maxsize=None)
def jitted_forward(graphdef):
  def fwd(state, tokens, **kwargs):
    return nnx.merge(graphdef, state).forward(tokens, **kwargs)
  return jax.jit(fwd, static_argnames=("moe_dispatch",))


def forward(model, tokens, **kwargs):
  graphdef, state = nnx.split(model)
  return jitted_forward(graphdef)(state, tokens, **kwargs)


def random_tokens(seed, shape, vocab=264):
  return jax.random.randint(jax.random.key(seed), shape, 1, vocab, dtype=jnp.int32)


@pytest.mark.parametrize("name", TINY)
def test_incremental_decoding_matches_full_forward(name):
  """Prefill of right-padded prompts of different lengths (with the head at every position, or
  at each row's last prompt position only, as the rollout prefills), then one-token steps with
  the cache, gives the logits of one full forward pass at every position (fp32, <= 1e-4)."""
  model = tiny_model(name)
  total, prompt_lens = 12, np.array([5, 3])
  tokens = random_tokens(0, (2, total))
  full = forward(model, tokens).logits
  prompt = jnp.where(jnp.arange(5)[None, :] < prompt_lens[:, None], tokens[:, :5], 0)
  cache = model.init_cache(2, 16)
  out = forward(model, prompt, cache=cache, num_new=jnp.asarray(prompt_lens, jnp.int32))
  for b, n in enumerate(prompt_lens):
    np.testing.assert_allclose(out.logits[b, :n], full[b, :n], atol=1e-4, rtol=0)
  # the rollout's prefill: the head at each row's last prompt position only, same logits
  last = forward(model, prompt, cache=cache, num_new=jnp.asarray(prompt_lens, jnp.int32),
                 head_at=jnp.asarray(prompt_lens - 1, jnp.int32))
  assert last.logits.shape == (2, 1, full.shape[-1])
  np.testing.assert_allclose(last.logits[:, 0], full[np.arange(2), prompt_lens - 1], atol=1e-4,
                             rtol=0)
  cache = out.cache
  for _ in range(total - prompt_lens.min()):
    lengths = np.asarray(cache["lengths"])
    step = jnp.asarray(np.asarray(tokens)[np.arange(2), np.minimum(lengths, total - 1)])[:, None]
    out = forward(model, step, cache=cache)
    cache = out.cache
    for b in range(2):
      if lengths[b] < total:
        np.testing.assert_allclose(out.logits[b, 0], full[b, lengths[b]], atol=1e-4, rtol=0)
  assert np.all(np.asarray(cache["lengths"]) >= total)


@pytest.mark.parametrize("name", TINY)
def test_causality(name):
  """Changing token t never changes logits at positions < t (DSA included: the indexer can
  never select a future token)."""
  model = tiny_model(name)
  tokens = random_tokens(1, (1, 16))
  base = forward(model, tokens)
  t = 9
  changed = tokens.at[0, t].set((tokens[0, t] + 7) % 264)
  out = forward(model, changed)
  np.testing.assert_array_equal(np.asarray(out.logits[0, :t]), np.asarray(base.logits[0, :t]))
  assert not np.allclose(out.logits[0, t:], base.logits[0, t:])
  for indices in (() if base.index_topk is None else base.index_topk):
    pos = np.arange(16)[None, :, None]
    assert np.all(np.asarray(indices) <= pos)


def graft(source, target):
  """Copies every parameter target has from source (same paths), e.g. DSA -> dense MLA."""
  src = dict(nnx.state(source).flat_state())
  tgt = nnx.state(target)
  for path, var in tgt.flat_state():
    var.set_value(src[path].get_value())
  nnx.update(target, tgt)
  return target


def test_dsa_with_large_topk_equals_dense_mla():
  """With top-k >= sequence length, DSA selects every earlier token: logits equal dense MLA
  (MHA mode) with the same weights; with a small top-k they differ."""
  big = build("tiny_moe_mla_dsa", seed=3, index_topk=64)
  dense = graft(big, build("tiny_moe_mla_dsa", seed=4, dsa=False))
  tokens = random_tokens(2, (2, 20))
  np.testing.assert_allclose(forward(big, tokens).logits, forward(dense, tokens).logits,
                             atol=1e-4, rtol=0)
  small = graft(big, build("tiny_moe_mla_dsa", seed=5, index_topk=4))
  assert not np.allclose(forward(small, tokens).logits, forward(dense, tokens).logits,
                         atol=1e-3)


def naive_dsa_attention(attn, x, topk):
  """Per-token loop: indexer scores, top-k by argsort, MHA-mode attention over the picks."""
  cfg = attn.cfg
  steps = x.shape[1]
  positions = jnp.arange(steps)[None]
  from models.layers import apply_rope
  q_latent = attn.q_norm(attn.wq_a(x))
  q = np.asarray(attn.wq_b(q_latent))[0]
  nope = cfg.qk_nope_head_dim
  q_pe = np.asarray(apply_rope(jnp.asarray(q[None, ..., nope:]), positions, cfg))[0]
  kv_a = attn.wkv_a(x)
  latent = attn.kv_norm(kv_a[..., :cfg.kv_lora_rank])
  k_pe = np.asarray(apply_rope(kv_a[..., cfg.kv_lora_rank:], positions, cfg))[0]
  kv = np.asarray(attn.wkv_b(latent))[0]
  k_nope, v = kv[..., :nope], kv[..., nope:]
  iq, ik, iw = (np.asarray(a)[0] for a in attn.indexer.scores_inputs(x, q_latent, positions))
  wo = np.asarray(attn.wo.kernel[...])
  outs = []
  for t in range(steps):
    scores = np.array([np.sum(iw[t] * np.maximum(iq[t] @ ik[s], 0.0)) for s in range(t + 1)])
    picks = np.argsort(-scores, kind="stable")[:topk]
    heads = []
    for h in range(cfg.n_heads):
      qh = np.concatenate([q[t, h, :nope], q_pe[t, h]])
      keys = np.stack([np.concatenate([k_nope[s, h], k_pe[s]]) for s in picks])
      logits = keys @ qh * cfg.softmax_scale
      p = np.exp(logits - logits.max())
      p /= p.sum()
      heads.append(p @ v[picks, h])
    outs.append(np.einsum("hv,hvd->d", np.stack(heads), wo))
  return np.stack(outs)


def test_dsa_small_topk_equals_naive_loop():
  """DSA attention with top-k < sequence length equals a per-token loop reference."""
  model = build("tiny_moe_mla_dsa", seed=6, index_topk=5)
  attn = model.layer(0).attn
  x = jax.random.normal(jax.random.key(0), (1, 13, model.cfg.d_model))
  steps = x.shape[1]
  mask = jnp.tril(jnp.ones((steps, steps), bool))[None]
  out, _, aux = attn(x, jnp.arange(steps)[None], mask)
  expected = naive_dsa_attention(attn, x, topk=5)
  np.testing.assert_allclose(np.asarray(out)[0], expected, atol=1e-4, rtol=1e-4)
  assert np.asarray(aux["index_topk"]).shape == (1, steps, 5)


def test_moe_ragged_equals_dense_reference_with_gradients():
  """Ragged-dot dispatch equals the one-hot dense reference (fp32 <= 1e-5), gradients too."""
  model = tiny_model("tiny_moe_mla_dsa")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = random_tokens(3, (2, 10))

  def loss(params, dispatch):
    m = nnx.merge(graphdef, params, rest)
    logits = m.forward(tokens, moe_dispatch=dispatch).logits
    return jnp.mean(jax.nn.log_softmax(logits)[..., 5]), logits

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (l_r, logits_r), g_r = grad_fn(params, "ragged")
  (l_d, logits_d), g_d = grad_fn(params, "dense")
  np.testing.assert_allclose(logits_r, logits_d, atol=1e-5, rtol=0)
  for a, b in zip(jax.tree.leaves(g_r), jax.tree.leaves(g_d)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["tiny_qwen3_moe", "tiny_moe_mla_dsa"])
def test_routing_replay(name):
  """Replaying the recorded expert ids reproduces the logits exactly; replaying other ids
  changes them, and the router still receives gradients under replay."""
  model = tiny_model(name)
  tokens = random_tokens(4, (2, 9))
  out = forward(model, tokens)
  assert out.routing.shape == (2, 9, model.cfg.n_moe_layers, model.cfg.n_experts_per_tok)
  replay = forward(model, tokens, routing=out.routing)
  np.testing.assert_array_equal(np.asarray(replay.logits), np.asarray(out.logits))
  other = (out.routing + 1) % model.cfg.n_experts
  assert not np.allclose(forward(model, tokens, routing=other).logits, out.logits)

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  def loss(params):
    return jnp.sum(nnx.merge(graphdef, params, rest).forward(tokens, routing=other).logits)
  grads = jax.jit(jax.grad(loss))(params)
  moe_stack = len(model.cfg.layer_stacks) - 1  # after the dense prefix, if any
  router_grad = grads["stacks"][moe_stack]["mlp"]["router"]["kernel"][...]  # [layers, D, E]
  assert jnp.all(jnp.abs(router_grad).sum(axis=(1, 2)) > 0)  # every MoE layer's router
  assert float(jnp.abs(router_grad).sum()) > 0


def test_group_limited_router_and_bias_update():
  """sigmoid_noaux picks experts only inside the top `topk_group` groups; the aux-free update
  raises the bias of under-loaded experts and lowers over-loaded ones."""
  model = tiny_model("tiny_moe_mla_dsa")
  router = model.layer(1).mlp.router
  cfg = model.cfg
  x = jax.random.normal(jax.random.key(1), (64, cfg.d_model))
  scores = router.scores(x)
  ids = np.asarray(router.select(scores))
  per_group = cfg.n_experts // cfg.n_group
  group_scores = np.sort(np.asarray(scores).reshape(64, cfg.n_group, per_group), -1)[..., -2:]
  best_groups = np.argsort(-group_scores.sum(-1), axis=-1)[:, :cfg.topk_group]
  for row in range(64):
    assert set(ids[row] // per_group) <= set(best_groups[row])
  bias = aux_free_bias_update(jnp.zeros(4), jnp.array([10.0, 0.0, 5.0, 5.0]), 0.01)
  np.testing.assert_allclose(bias, [-0.01, 0.01, 0.0, 0.0])


@pytest.mark.parametrize("name", TINY)
def test_gradients_finite(name):
  """Every tiny preset gives finite, non-zero gradients of a next-token loss."""
  model = tiny_model(name)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tokens = random_tokens(5, (2, 12))

  def loss(params):
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  assert np.isfinite(float(value))
  leaves = jax.tree.leaves(grads)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  assert sum(float(jnp.abs(g).sum()) for g in leaves) > 0


def test_scalar_head():
  """The scalar-head variant shares the trunk and returns one fp32 value per token."""
  model = build("tiny_moe_mla_dsa", head="scalar")
  values = model(random_tokens(6, (3, 7)))
  assert values.shape == (3, 7) and values.dtype == jnp.float32


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_real_preset_parameter_counts(name):
  """Abstract (eval_shape) parameter totals match the published totals within 1%. Published
  active counts are rounded to two significant figures and differ in whether embeddings count,
  so they are checked within 2%; DeepSeek-V3.2's active count adds exactly the indexers."""
  counts = param_counts(get_config(name))
  published = PUBLISHED_PARAMS[name]
  assert abs(counts["total"] / 1e9 / published["total"] - 1) <= 0.01, counts
  if name == "deepseek-v3.2-671b":
    base = param_counts(get_config("deepseek-v3-671b"))
    cfg = get_config(name)
    indexer = cfg.n_layers * (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim
                              + cfg.d_model * cfg.index_head_dim + 2 * cfg.index_head_dim
                              + cfg.d_model * cfg.index_n_heads)
    assert counts["active"] == base["active"] + indexer
  elif "active" in published:
    assert abs(counts["active"] / 1e9 / published["active"] - 1) <= 0.02, counts


def test_bad_preset_and_inconsistent_configs_name_the_field():
  """Construction fails with a message naming the culprit field or preset."""
  with pytest.raises(ValueError, match="unknown model preset 'tiny_dence'"):
    get_config("tiny_dence")
  with pytest.raises(ValueError, match="n_kv_heads"):
    get_config("tiny_dense", n_kv_heads=3)
  with pytest.raises(ValueError, match="n_experts_per_tok"):
    get_config("tiny_qwen3_moe", n_experts_per_tok=9)
  with pytest.raises(ValueError, match="n_group"):
    get_config("tiny_moe_mla_dsa", n_group=3)
  with pytest.raises(ValueError, match="dsa"):
    get_config("tiny_dense", dsa=True)
  with pytest.raises(ValueError, match="router"):
    get_config("tiny_qwen3_moe", router="sparsemax")
  with pytest.raises(ValueError, match="unknown ModelConfig field"):
    get_config("tiny_dense", n_head=4)
  with pytest.raises(ValueError, match="kv_lora_rank"):
    ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, mlp_dim=8, attention="mla")
  assert set(TINY) <= set(PRESETS)


def test_every_attention_kind_has_one_entry_and_one_call_signature():
  """models.attention.ATTENTION holds an entry for exactly the kinds a ModelConfig accepts; every
  kind's module takes the same call signature (the transformer calls them alike) and is the
  module the model builds."""
  assert tuple(ATTENTION) == ATTENTION_KINDS
  signatures = {kind: inspect.signature(entry.module.__call__) for kind, entry in ATTENTION.items()}
  assert len(set(map(str, signatures.values()))) == 1, signatures
  for name in TINY:
    cfg = get_config(name)
    attn = tiny_model(name).stacks[0].attn
    assert type(attn) is ATTENTION[cfg.attention].module


def test_cache_write_drops_past_the_end():
  """Cache writes land at each row's own offset; writes past the buffer are dropped."""
  buf = jnp.zeros((2, 4, 1))
  new = jnp.array([[1.0, 2.0], [11.0, 12.0]])[:, :, None]
  out = ops.write_slots(buf, new, jnp.array([1, 3]))
  np.testing.assert_array_equal(np.asarray(out)[..., 0], [[0, 1, 2, 0], [0, 0, 0, 11]])


@pytest.mark.parametrize("name,remat", [("tiny_moe_mla_dsa", "none"), ("tiny_qwen3_moe", "full"),
                                        ("tiny_dense", "names")])
def test_scanned_stacks_equal_the_layers_run_one_by_one(name, remat):
  """Training's scan over each stack of layers (a MoE model's dense prefix and MoE layers; remat
  inside its body) gives the logits, routing and parameter gradients of the same layers run one
  by one (`unstack_layers`, the CPU rollout's layout); `layer(i)` is layer i of that stack."""
  names = "attn_in,mlp_out" if remat == "names" else ""
  model = build(name, seed=2, n_layers=3, remat=remat, remat_names=names)
  unstacked = build(name, seed=2, n_layers=3, remat=remat, remat_names=names)
  unstacked.unstack_layers()
  tokens = random_tokens(7, (2, 11))

  def run(m):
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    def loss(params):
      out = nnx.merge(graphdef, params, rest).forward(tokens)
      return jnp.mean(jax.nn.log_softmax(out.logits)[..., 3]), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return out, grads
  out, grads = run(model)
  out1, grads1 = run(unstacked)
  np.testing.assert_allclose(out.logits, out1.logits, atol=1e-5, rtol=1e-5)
  # scan_layers=False unrolls the same scan: the same parameters, logits and gradients.
  out2, grads2 = run(build(name, seed=2, n_layers=3, remat=remat, remat_names=names,
                           scan_layers=False))
  np.testing.assert_allclose(out2.logits, out.logits, atol=1e-5, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads), strict=True):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
  if model.cfg.is_moe:
    np.testing.assert_array_equal(out.routing, out1.routing)
  for i in range(model.cfg.n_layers):
    g, (first, _) = next((g, s) for g, s in enumerate(model.cfg.layer_stacks)
                         if s[0] <= i < s[0] + s[1])
    for a, b in zip(jax.tree.leaves(nnx.state(model.layer(i))),
                    jax.tree.leaves(nnx.state(unstacked.stacks[g][i - first])), strict=True):
      np.testing.assert_array_equal(a, b)
    stacked = jax.tree.map(lambda a, j=i - first: a[j], grads["stacks"][g])
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(grads1["stacks"][g][i - first]),
                    strict=True):
      np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_unrolled_layers_count_every_layer_in_the_compiled_flops():
  """XLA's cost analysis counts a scan's body once: the scanned update's compiled FLOPs do not
  grow with depth, the unrolled one's (scan_layers=False, what the dry run compiles to show the
  compute wasted by remat and capacity) grow by a layer's FLOPs per layer."""
  tokens = random_tokens(3, (2, 16))

  def flops(n_layers, scan_layers):
    model = build("tiny_dense", seed=1, n_layers=n_layers, remat="full", scan_layers=scan_layers)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    def loss(params):
      return jnp.mean(nnx.merge(graphdef, params, rest).forward(tokens).logits)
    return jax.jit(jax.grad(loss)).lower(params).compile().cost_analysis()["flops"]
  assert flops(4, True) == pytest.approx(flops(2, True), rel=0.01)
  two, three, four = (flops(n, False) for n in (2, 3, 4))
  assert four - three == pytest.approx(three - two, rel=0.05)
  assert four - three > 0.1 * two
