"""Rollout engine tests: the Trajectories layout, logp_old against the trainer's teacher-forced
recomputation (dense, MoE with keep-routing, DSA; with keep-sampling-mask), continuous vs
static batching, no recompilation across prompt lengths, sampled frequencies through the
engine, sharded generation, and the cached-vs-naive decoding benchmark."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from models import ops
from models import sharding as sharding_lib
from models.transformer import Transformer, build
from rl.rollout import engine, trajectories
from rl.core import sampling

STOP_IDS = tuple(range(1, 30))  # ~11% of the vocabulary: responses end at varied lengths
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3] * 9, [40, 41], [77]]

# One sampling config per model exercises everything at once: temperature, top-p, top-k,
# vocab_limit, keep-sampling-mask, keep-routing and continuous batching (3 slots, 10 rows).
FULL_CFG = engine.RolloutConfig(
    max_new_tokens=10, temperature=0.7, top_p=0.9, top_k=40, vocab_limit=263,
    stop_ids=STOP_IDS, prompt_bucket=8, batch_size=3, keep_sampling_mask=True,
    keep_routing=True)
PLAIN_CFG = engine.RolloutConfig(max_new_tokens=10, temperature=1.0, stop_ids=STOP_IDS,
                                  prompt_bucket=8)


@functools.lru_cache(maxsize=None)
def tiny(name, **overrides):
  graphdef, state = nnx.split(build(name, seed=1, **overrides))
  return graphdef, state


@functools.lru_cache(maxsize=None)
def trainer_logprobs_fn(graphdef, temperature):
  """What the trainer does: one teacher-forced forward over the tokens; token t's log-prob
  comes from the logits at t - 1, replaying the recorded routing and, when given, renormalised
  over the recorded kept mask. Also returns the full-vocabulary log-probs and the routing the
  forward pass picks by itself."""

  @jax.jit
  def run(state, tokens, routing, kept_ids):
    model = nnx.merge(graphdef, state)
    out = model.forward(tokens, routing=routing)
    own_routing = model.forward(tokens).routing if routing is not None else None
    targets = tokens[:, 1:, None]

    def token_logp(kept):
      logp = sampling.masked_logprobs(out.logits[:, :-1], temperature=temperature,
                                      kept_mask=kept)
      return jnp.pad(jnp.take_along_axis(logp, targets, axis=-1)[..., 0], ((0, 0), (1, 0)))

    kept = None
    if kept_ids is not None:
      kept = sampling.kept_mask_from_ids(kept_ids[:, 1:], out.logits.shape[-1])
    return token_logp(kept), token_logp(None), own_routing

  return run


@functools.lru_cache(maxsize=None)
def generated(name, cfg, num_samples=2, seed=0, batch_size=None):
  graphdef, state = tiny(name)
  if batch_size is not None:
    cfg = cfg.replace(batch_size=batch_size)
  return trajectories.generate(graphdef, state, PROMPTS, jax.random.key(seed), cfg,
                                num_samples=num_samples, policy_version=3, return_stats=True)


def check_layout(traj, cfg, prompts, num_samples):
  """Each row is its prompt, then a contiguous response, then padding, as documented."""
  tokens = np.asarray(traj.tokens)
  mask = np.asarray(traj.response_mask)
  lens = np.asarray(traj.prompt_lens)
  logp_old = np.asarray(traj.logp_old)
  finished, truncated = np.asarray(traj.finished), np.asarray(traj.truncated)
  assert np.asarray(traj.group_id).tolist() == np.repeat(np.arange(len(prompts)),
                                                          num_samples).tolist()
  for n, row in enumerate(tokens):
    prompt = prompts[n // num_samples]
    assert lens[n] == len(prompt) and row[:lens[n]].tolist() == prompt
    length = int(mask[n].sum())
    assert 1 <= length <= cfg.max_new_tokens
    assert mask[n, lens[n]:lens[n] + length].all()
    response = row[lens[n]:lens[n] + length]
    assert np.all(row[lens[n] + length:] == cfg.pad_id)
    assert not np.isin(response[:-1], cfg.stop_ids).any()
    assert finished[n] == (response[-1] in cfg.stop_ids)
    assert truncated[n] == (not finished[n] and length == cfg.max_new_tokens)
    assert np.all(logp_old[n][mask[n] == 0] == 0) and np.all(logp_old[n][mask[n] == 1] < 0)
    if cfg.vocab_limit is not None:
      assert response.max() < cfg.vocab_limit
  versions = np.asarray(traj.policy_version)
  assert versions.shape == tokens.shape and np.all(versions == 3)


@pytest.mark.parametrize("name", ["tiny_qwen3_moe", "tiny_moe_mla_dsa"])
def test_logp_old_equals_trainer_recomputation(name):
  """Teacher-forced log-probs of the generated tokens, with the recorded routing and kept mask
  replayed, equal the sampler's logp_old (fp32, <= 1e-5) for a GQA MoE and an MLA+DSA MoE model
  (the dense model is covered by the continuous-batching test); every sampled token lies in its
  recorded kept set; prompt and padding positions keep every id; routing is recorded for every
  processed token, the stop token included."""
  traj, _ = generated(name, FULL_CFG)
  graphdef, state = tiny(name)
  check_layout(traj, FULL_CFG, PROMPTS, 2)
  mask = np.asarray(traj.response_mask).astype(bool)
  tokens = jnp.asarray(traj.tokens)
  logp, full, own_routing = trainer_logprobs_fn(graphdef, FULL_CFG.temperature)(
      state, tokens, traj.routing, traj.kept_ids)
  logp, full = np.asarray(logp), np.asarray(full)
  np.testing.assert_allclose(logp[mask], np.asarray(traj.logp_old)[mask], atol=1e-5, rtol=0)

  # The record: top_k int32 ids per position, 4 * top_k bytes per token (a bit array: V / 8).
  assert traj.kept_ids.dtype == np.int32 and traj.kept_ids.shape == (*tokens.shape, 40)
  assert traj.kept_ids.nbytes // tokens.size == 4 * FULL_CFG.top_k
  kept = np.asarray(sampling.kept_mask_from_ids(traj.kept_ids, 264))
  assert np.take_along_axis(kept, np.asarray(tokens)[..., None], -1)[..., 0][mask].all()
  assert kept[~mask].all()
  assert 0 < kept[mask].sum(-1).mean() < 263  # top-p / top-k really removed ids
  # Without the kept mask the trainer's full-vocabulary log-probs are higher-entropy: they
  # differ, which is why keep-sampling-mask exists.
  assert np.all(full[mask] < np.asarray(traj.logp_old)[mask] + 1e-6)

  cfg = nnx.merge(graphdef, state).cfg
  routing = np.asarray(traj.routing)
  assert routing.shape == (*tokens.shape, cfg.n_moe_layers, cfg.n_experts_per_tok)
  # Routing of every processed token equals what the trainer's own forward picks (same weights).
  processed = (np.arange(tokens.shape[1])[None, :]
               < (np.asarray(traj.prompt_lens) + mask.sum(-1))[:, None])
  np.testing.assert_array_equal(np.sort(np.asarray(own_routing), -1)[processed],
                                np.sort(routing, -1)[processed])


@pytest.mark.parametrize("cap", [16, 400])
def test_top_p_alone_records_the_nucleus_within_its_cap(cap):
  """Keep-sampling-mask with top-p alone (the DeepSeek-V3.2 setting) on the MLA+DSA MoE model:
  each sampled token's record rebuilds the sampler's top-p nucleus, recomputed here from the
  trainer's teacher-forced logits, wherever it has at most max_kept_ids ids; a wider one is cut
  to its max_kept_ids most probable ids, flagged and counted (cap 16: every token; a cap over
  the vocabulary: none). The trainer's log-probs over the rebuilt mask equal logp_old."""
  cfg = engine.RolloutConfig(max_new_tokens=10, temperature=0.7, top_p=0.9, stop_ids=STOP_IDS,
                             prompt_bucket=8, batch_size=3, keep_sampling_mask=True,
                             max_kept_ids=cap)
  traj, _ = generated("tiny_moe_mla_dsa", cfg)
  graphdef, state = tiny("tiny_moe_mla_dsa")
  mask = np.asarray(traj.response_mask).astype(bool)
  tokens = jnp.asarray(traj.tokens)
  assert traj.kept_ids.shape == (*tokens.shape, min(cap, 264) + 1)
  logp, _, _ = trainer_logprobs_fn(graphdef, cfg.temperature)(state, tokens, None,
                                                              traj.kept_ids)
  np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(traj.logp_old)[mask],
                             atol=1e-5, rtol=0)
  logits = jax.jit(lambda st, t: nnx.merge(graphdef, st).forward(t).logits)(state, tokens)
  nucleus = np.asarray(sampling.kept_set(logits[:, :-1] / cfg.temperature, top_p=cfg.top_p))
  rebuilt = np.asarray(sampling.kept_mask_from_ids(traj.kept_ids[:, 1:], 264))
  record, nucleus, rebuilt = (x[mask[:, 1:]] for x in (traj.kept_ids[:, 1:], nucleus, rebuilt))
  wide = nucleus.sum(-1) > cap
  np.testing.assert_array_equal(rebuilt[~wide], nucleus[~wide])
  assert np.all(rebuilt[wide].sum(-1) == cap) and not (rebuilt[wide] & ~nucleus[wide]).any()
  np.testing.assert_array_equal(record[:, -1] == sampling.CUT_FLAG, wide)
  assert sampling.cut_tokens(traj.kept_ids) == wide.sum()
  # The random model's nuclei hold ~225 of the 264 ids: all cut at 16, none over 264.
  assert wide.all() if cap == 16 else not wide.any()


def test_continuous_batching_equals_static():
  """Continuous batching (3 slots for 10 sequences) returns exactly the tokens, stop flags and
  (to fp32 rounding) log-probs of static batching with the same seed, in fewer decode steps
  than static batching in waves of 3 would need; plain temperature sampling's logp_old is the
  trainer's log_softmax(logits / T) recomputation."""
  static, static_stats = generated("tiny_dense", PLAIN_CFG)
  continuous, cont_stats = generated("tiny_dense", PLAIN_CFG, batch_size=3)
  check_layout(static, PLAIN_CFG, PROMPTS, 2)
  np.testing.assert_array_equal(np.asarray(continuous.tokens), np.asarray(static.tokens))
  np.testing.assert_array_equal(continuous.finished, static.finished)
  np.testing.assert_array_equal(continuous.truncated, static.truncated)
  np.testing.assert_allclose(continuous.logp_old, static.logp_old, atol=1e-5, rtol=0)
  lengths = np.asarray(static.response_mask).sum(-1)
  assert len(set(lengths.tolist())) > 2, "test needs varied response lengths"
  waves = sum(lengths[i:i + 3].max() for i in range(0, len(lengths), 3))
  assert cont_stats["decode_steps"] < waves
  assert static_stats["decode_steps"] == lengths.max()
  graphdef, state = tiny("tiny_dense")
  logp = np.asarray(trainer_logprobs_fn(graphdef, 1.0)(state, jnp.asarray(static.tokens),
                                                       None, None)[0])
  mask = np.asarray(static.response_mask).astype(bool)
  np.testing.assert_allclose(logp[mask], np.asarray(static.logp_old)[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name,cfg", [
    ("tiny_dense", PLAIN_CFG), ("tiny_qwen3_moe", FULL_CFG.replace(prefill_batch=3)),
    ("tiny_moe_mla_dsa", FULL_CFG.replace(prefill_batch=3))])
def test_a_prompts_samples_share_one_prefill(name, cfg):
  """A prompt's G samples prefilled once (group_size=G: its KV rows and last logits copied to
  the group's slots) give exactly the tokens, stop flags, routing and kept ids of G separate
  prefills, and their log-probs to fp32 rounding (a prefill over fewer rows may round MLA's
  products differently: 2.4e-7 seen): static batching (dense) and continuous batching over 3 slots, where a
  group straddles refills of 3 rows (MoE with keep-routing and keep-sampling-mask, MLA + DSA)."""
  graphdef, state = tiny(name)
  ids, lens = trajectories.prompt_batch(PROMPTS, cfg)
  ids, lens = np.repeat(ids, 4, axis=0), np.repeat(lens, 4)
  shared, alone = (engine.run_engine(graphdef, state, ids, lens, jax.random.key(0), cfg,
                                     group_size=g) for g in (4, 1))
  assert shared["prefill_calls"] == alone["prefill_calls"]
  np.testing.assert_allclose(shared["logp_old"], alone["logp_old"], atol=1e-6, rtol=0)
  for key in ("tokens", "stopped", "new_count", "routing", "kept_ids"):
    assert (key in shared) == (key in alone)
    if key in alone:
      np.testing.assert_array_equal(np.asarray(shared[key]), np.asarray(alone[key]), key)
  assert len(set(np.asarray(alone["new_count"]).tolist())) > 2, "samples should differ"
  ids[[5, 13], 0] += 1
  with pytest.raises(ValueError, match=r"group\(s\) \[1, 3\] do not share one context"):
    engine.run_engine(graphdef, state, ids, lens, jax.random.key(0), cfg, group_size=4)
  with pytest.raises(ValueError, match="group_size=8: must divide the 20 sequences"):
    engine.run_engine(graphdef, state, ids, lens, jax.random.key(0), cfg, group_size=8)


def test_shared_prefill_divides_the_prefill_flops_by_the_group_size():
  """XLA's compiled cost of a static-batching engine call (64 sequences of 256 prompt tokens,
  1 new token: the prefill dominates) falls by about the group size when groups of 4 and 16
  share their prefill."""
  graphdef, state = tiny("tiny_dense")
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  cfg = engine.RolloutConfig(max_new_tokens=1, prompt_bucket=8)
  flops = {g: engine.lower_engine(graphdef, abstract, cfg, sequences=64, prompt_width=256,
                                  group_size=g).compile().cost_analysis()["flops"]
           for g in (1, 4, 16)}
  assert 3.6 < flops[1] / flops[4] <= 4 and 13 < flops[1] / flops[16] <= 16, flops


def test_per_prompt_stop_ids_and_length_caps():
  """Per-prompt extra stop ids and max_new_tokens cut each response exactly where the
  unconstrained run (same seed) first meets them: the kept part is identical, a stop id ends a
  row as finished, a length cap as truncated, and neither recompiles the engine."""
  reference, _ = generated("tiny_dense", PLAIN_CFG)
  ref_tokens = np.asarray(reference.tokens)
  ref_lens = np.asarray(reference.response_mask).sum(-1)
  graphdef, state = tiny("tiny_dense")
  caps = [2, 10, 10, 10, 1]
  # Prompt 2's first sample stops at its 2nd response token if that token becomes a stop id.
  row = 4
  extra_stop = int(ref_tokens[row, len(PROMPTS[2]) + 1])
  assert ref_lens[row] > 2 and extra_stop not in ref_tokens[row, len(PROMPTS[2]):][:1]
  stop_ids = [[], [], [extra_stop], [], []]
  before = engine.trace_count()
  traj = trajectories.generate(graphdef, state, PROMPTS, jax.random.key(0), PLAIN_CFG,
                                num_samples=2, policy_version=3, stop_ids=stop_ids,
                                max_new_tokens=caps)
  assert engine.trace_count() == before
  tokens, lens = np.asarray(traj.tokens), np.asarray(traj.response_mask).sum(-1)
  for n in range(len(tokens)):
    p = len(PROMPTS[n // 2])
    response = ref_tokens[n, p:p + ref_lens[n]].tolist()
    stops = set(STOP_IDS) | set(stop_ids[n // 2])
    cut = next((i + 1 for i, t in enumerate(response) if t in stops), len(response))
    expected = response[:min(cut, caps[n // 2])]
    assert tokens[n, p:p + lens[n]].tolist() == expected
    assert traj.finished[n] == (expected[-1] in stops)
    assert traj.truncated[n] == (not traj.finished[n] and lens[n] == caps[n // 2])
  assert lens[row] == 2 and traj.finished[row]


def test_no_recompilation_across_prompt_lengths():
  """After the first call, calls with other prompt lengths (inside the bucket), other prompt
  counts (10 and 12 rows both pad to 4 waves of 3 slots) and other seeds reuse the compiled
  engine."""
  graphdef, state = tiny("tiny_dense")
  cfg = PLAIN_CFG.replace(batch_size=3)
  rng = np.random.default_rng(0)

  def call(seed, n_prompts):
    prompts = [rng.integers(30, 260, rng.integers(1, 9)).tolist() for _ in range(n_prompts)]
    return trajectories.generate(graphdef, state, prompts, jax.random.key(seed), cfg, num_samples=2)

  call(0, 5)
  before = engine.trace_count()
  for seed, n_prompts in [(1, 5), (2, 6), (3, 5)]:
    traj = call(seed, n_prompts)
  assert engine.trace_count() == before
  assert np.asarray(traj.tokens).shape == (10, 8 + cfg.max_new_tokens)


@pytest.mark.parametrize("name,keep_routing,forwards", [
    ("tiny_dense", False, 2), ("tiny_qwen3_moe", False, 2), ("tiny_qwen3_moe", True, 3)])
def test_the_last_drawn_tokens_go_through_no_forward(name, keep_routing, forwards, monkeypatch):
  """3 new tokens per row take 3 draws but 2 decode forwards, as HF `generate` and vLLM do: the
  step that draws every row's last token runs no forward, since no one reads its logits. With
  keep-routing the third forward runs, because it records the last token's routing. An equal
  graphdef that is a different object reuses the compiled engine."""
  graphdef, state = tiny(name)
  seen = []

  def counted(self, tokens, **kwargs):
    if tokens.shape[1] == 1:  # a decode step (a prefill sees the prompt width)
      jax.debug.callback(lambda rows: seen.append(int(rows.sum())), kwargs["num_new"])
    return forward(self, tokens, **kwargs)

  forward = Transformer.forward
  monkeypatch.setattr(Transformer, "forward", counted)
  engine._compiled_engine.cache_clear()  # compile with the counting forward
  try:
    cfg = engine.RolloutConfig(max_new_tokens=3, greedy=True, keep_routing=keep_routing)
    ids, lens = np.array([[5, 6, 7], [8, 9, 0]], np.int32), np.array([3, 2], np.int32)
    out = engine.run_engine(graphdef, state, ids, lens, jax.random.key(0), cfg)
    jax.effects_barrier()
    assert int(out["decode_steps"]) == 3 and np.asarray(out["new_count"]).tolist() == [3, 3]
    assert seen == [2] * forwards
    before = engine.trace_count()
    equal_graphdef = nnx.split(nnx.merge(graphdef, state))[0]
    assert equal_graphdef is not graphdef and equal_graphdef == graphdef
    again = engine.run_engine(equal_graphdef, state, ids, lens, jax.random.key(0), cfg)
    assert engine.trace_count() == before
    np.testing.assert_array_equal(np.asarray(again["tokens"]), np.asarray(out["tokens"]))
  finally:
    engine._compiled_engine.cache_clear()  # later tests compile the plain forward again


def test_engine_frequencies_match_softmax():
  """On a 16-token vocabulary, first tokens drawn by the engine for one prompt pass a
  chi-square test against softmax(prefill logits / T)."""
  graphdef, state = tiny("tiny_dense", vocab_size=16, init_std=0.5)
  cfg = engine.RolloutConfig(max_new_tokens=1, temperature=0.8, prompt_bucket=4)
  draws = 3000
  traj = trajectories.generate(graphdef, state, [[3, 4, 5]], jax.random.key(1), cfg,
                                num_samples=draws)
  first = np.asarray(traj.tokens)[:, 3]
  logits = nnx.merge(graphdef, state).forward(jnp.array([[3, 4, 5]])).logits[0, -1]
  probs = np.asarray(jax.nn.softmax(logits / 0.8), np.float64)
  assert probs.max() > 3 * probs.min()  # a distribution far from uniform
  counts = np.bincount(first, minlength=16)
  assert stats.chisquare(counts, probs / probs.sum() * draws).pvalue > 1e-3


def test_sharded_generation_equals_unsharded():
  """Generation on a (data=4, tensor=2) mesh of the 8 CPU devices, with rows (slots and
  sequences) sharded over data and parameters over tensor, returns the unsharded samples for
  the same seed (sampled, which covers the greedy argmax path too: the same logits and RNG
  streams give the same tokens). One extra prompt makes 12 rows: rows do not depend on the
  rest of the batch, and the outputs stay sharded over data."""
  graphdef, state = tiny("tiny_dense")
  reference, _ = generated("tiny_dense", PLAIN_CFG)
  mesh = sharding_lib.make_mesh({"data": 4, "tensor": 2})
  sharded_state = jax.device_put(state, sharding_lib.state_shardings(state, mesh))
  traj = trajectories.generate(graphdef, sharded_state, PROMPTS + [[9, 9]], jax.random.key(0),
                                PLAIN_CFG, num_samples=2, policy_version=3, mesh=mesh)
  rows = len(PROMPTS) * 2
  np.testing.assert_array_equal(np.asarray(traj.tokens)[:rows], np.asarray(reference.tokens))
  np.testing.assert_allclose(np.asarray(traj.logp_old)[:rows], reference.logp_old, atol=1e-5,
                             rtol=0)
  assert traj.tokens.sharding.spec[0] == "data"


def test_keep_sampling_mask_records_nothing_without_truncation():
  """A sampler that keeps every id (top_p 1, top_k 0) has nothing to record: keep-sampling-mask
  adds no field and changes nothing. Top-p without top-k is refused (its kept set is
  unbounded)."""
  plain, _ = generated("tiny_dense", PLAIN_CFG)
  traj, _ = generated("tiny_dense", PLAIN_CFG.replace(keep_sampling_mask=True))
  assert traj.kept_ids is None
  np.testing.assert_array_equal(np.asarray(traj.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(traj.logp_old), np.asarray(plain.logp_old))
  with pytest.raises(ValueError, match="keep_sampling_mask: top_p=0.9 with top_k=0"):
    PLAIN_CFG.replace(top_p=0.9, keep_sampling_mask=True)
  assert PLAIN_CFG.replace(top_p=0.9, top_k=8, keep_sampling_mask=True).top_k == 8


def test_config_errors_name_the_field():
  """Bad rollout settings and empty prompts fail early with the field or row named."""
  with pytest.raises(ValueError, match="temperature=0"):
    engine.RolloutConfig(temperature=0.0)
  with pytest.raises(ValueError, match="top_p=0"):
    engine.RolloutConfig(top_p=0.0)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    engine.RolloutConfig(max_new_tokens=0)
  with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
    trajectories.prompt_batch([[1], []], PLAIN_CFG)
  with pytest.raises(ValueError, match="max_prompt_len=2"):
    trajectories.prompt_batch([[1, 2, 3]], PLAIN_CFG.replace(max_prompt_len=2))
  assert engine.RolloutConfig(temperature=0.0, greedy=True).greedy


@pytest.mark.slow
def test_cached_decoding_ten_times_faster_than_full_forward():
  """CPU benchmark: KV-cached jitted decoding of 256 new tokens on the tiny model is >= 10x
  faster than recomputing the full forward pass per token (same run), with the same tokens."""
  from launch.bench_rollout import benchmark
  results = benchmark("tiny_dense", 8, 32, 256, repeats=2, naive=True, log=lambda _: None)
  assert results["speedup"] >= 10, results
  assert results["naive_same_tokens"] > 0.99


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_qwen3_moe", "tiny_moe_mla_dsa"])
def test_expert_parallel_generation_equals_unsharded(name):
  """MoE generation on a (data=2, expert=2, tensor=2) mesh (experts sharded over `expert`)
  returns the unsharded samples, log-probs and recorded routing."""
  graphdef, state = tiny(name)
  cfg = FULL_CFG.replace(batch_size=4)
  prompts = PROMPTS[:4]
  reference = trajectories.generate(graphdef, state, prompts, jax.random.key(0), cfg, num_samples=2)
  mesh = sharding_lib.make_mesh({"data": 2, "expert": 2, "tensor": 2})
  sharded_state = jax.device_put(state, sharding_lib.state_shardings(state, mesh))
  traj = trajectories.generate(graphdef, sharded_state, prompts, jax.random.key(0), cfg,
                                num_samples=2, mesh=mesh)
  np.testing.assert_array_equal(np.asarray(traj.tokens), np.asarray(reference.tokens))
  np.testing.assert_array_equal(np.asarray(traj.routing), np.asarray(reference.routing))
  np.testing.assert_allclose(traj.logp_old, reference.logp_old, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows", [1, 4])
def test_bf16_engine_on_cpu_matches_the_bf16_trainer(rows):
  """A bf16 model decodes through the engine's CPU products (output-major kernels, fp32
  accumulation, a single row padded to two) at 1 and 4 rows, and its log-probs are the bf16
  trainer's to bf16 rounding. Without the barrier that materialises the transposed kernels,
  XLA folds the transpose into a bf16 x bf16 -> fp32 product XLA:CPU cannot run."""
  graphdef, state = tiny("tiny_dense", dtype="bfloat16", param_dtype="bfloat16")
  prompts = PROMPTS[:rows]
  traj = trajectories.generate(graphdef, state, prompts, jax.random.key(4), PLAIN_CFG)
  logp = trainer_logprobs_fn(graphdef, 1.0)(state, jnp.asarray(traj.tokens), None, None)[0]
  mask = np.asarray(traj.response_mask, bool)
  assert mask.sum() > 0
  np.testing.assert_allclose(np.asarray(logp)[mask], np.asarray(traj.logp_old)[mask], atol=0.05,
                             rtol=0)


@pytest.mark.parametrize("name", ["tiny_qwen3_moe", "tiny_moe_mla_dsa"])
def test_growing_cache_widths_do_not_change_the_samples(name, monkeypatch):
  """Decoding through a cache that grows in phases (prompt + 2, 5, 7, then all 10 new tokens'
  slots) gives the tokens, routing, kept ids and log-probs (fp32, <= 1e-6) of one full-width
  cache, for continuous batching with refills in every phase, GQA and MLA+DSA; the engine's own
  rule grows the cache on CPU from 128 new tokens."""
  assert len(engine.cache_widths(64, 128)) == 4 and engine.cache_widths(64, 128)[-1] == 192
  assert engine.cache_widths(8, 10) == (18,)
  cfg = FULL_CFG.replace(max_prompt_len=9)  # the longest prompt: rows reach every width
  full, full_stats = generated(name, cfg)
  engine._compiled_engine.cache_clear()  # the default rule's program is cached: compile anew
  monkeypatch.setattr(engine, "cache_widths",
                      lambda prompt, new: tuple(prompt + w for w in (2, 5, 7, new)))
  graphdef, state = tiny(name)
  grown, grown_stats = trajectories.generate(graphdef, state, PROMPTS, jax.random.key(0), cfg,
                                             num_samples=2, policy_version=3,
                                             return_stats=True)
  engine._compiled_engine.cache_clear()  # later tests compile the default rule again
  np.testing.assert_array_equal(np.asarray(grown.tokens), np.asarray(full.tokens))
  np.testing.assert_array_equal(np.asarray(grown.routing), np.asarray(full.routing))
  np.testing.assert_array_equal(np.asarray(grown.kept_ids), np.asarray(full.kept_ids))
  np.testing.assert_allclose(grown.logp_old, full.logp_old, atol=1e-6, rtol=0)
  assert grown_stats["decode_steps"] == full_stats["decode_steps"]
  lengths = np.asarray(full.prompt_lens) + np.asarray(full.response_mask).sum(-1)
  assert lengths.max() > 9 + 5  # some row decoded in the third phase (past two widths)


@pytest.mark.parametrize("name", ["tiny_dense", "tiny_qwen3_moe"])
def test_weights_laid_out_once_give_the_same_rollout(name):
  """`decode_weights` lays the weights out once for several engine calls: the engine's own
  per-call layout pass then returns every array as it was given (nothing copied again), and
  the rollout's tokens, log-probs and routing equal those from the trainer's layout."""
  graphdef, state = tiny(name)
  laid_graphdef, laid = engine.decode_weights(graphdef, state)
  assert laid_graphdef != graphdef  # on CPU: layers unstacked, kernels stored output-major
  again_graphdef, again = ops.sampler_layout(laid_graphdef, laid)
  assert again_graphdef == laid_graphdef
  assert all(a is b for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(laid)))
  cfg = FULL_CFG.replace(max_prompt_len=9)
  runs = [trajectories.generate(g, s, PROMPTS, jax.random.key(0), cfg, num_samples=2)
          for g, s in ((graphdef, state), (laid_graphdef, laid))]
  np.testing.assert_array_equal(np.asarray(runs[1].tokens), np.asarray(runs[0].tokens))
  np.testing.assert_array_equal(np.asarray(runs[1].routing), np.asarray(runs[0].routing))
  np.testing.assert_allclose(runs[1].logp_old, runs[0].logp_old, atol=1e-6, rtol=0)
