"""Tests of rl/tool_use/: the tool-call format, error handling, the reasoning-retention rule, the
multi-turn rollout driven by a scripted policy (masks, turn limit, resumed RNG index) and by
the real engine (pausing does not change the samples), the verifier + judge reward, the SFT
warm start on expert transcripts, the
zero gradient at tool-result positions through the real policy objective, and a few RL steps
of the tool demo end to end on the tiny model."""

import json
import os
import time
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from configs import tool_demo
from models.config import get_config as get_model_config
from models.padding import round_up
from models.tokenizer import ByteTokenizer
from models.transformer import Transformer
from rl.config.defaults import model_section
from rl.config.validation import validate
from rl.core import algorithms
from rl.core import train_step as ts
from rl.rewards import sandbox
from rl.rewards.genrm import GenerativeRM
from rl.rollout.engine import RolloutConfig
from rl.tool_use import calls, context, demonstrations, environments, reward
from rl.tool_use.calls import register_tool
from rl.tool_use.demonstrations import DemonstrationPolicy
from rl.tool_use.rollout import ToolRollout, ToolRolloutConfig
from rl.jobs.batch import build_batch
from rl.jobs.trainer import Trainer

TOKENIZER = ByteTokenizer()
SCRIPT_LOGP = -0.25
needs_bwrap = pytest.mark.skipif(sandbox.bwrap_path() is None,
                                 reason="bubblewrap (bwrap) is not installed")


@register_tool("test_raises", "always fails", {})
def _raises(ctx):
  raise KeyError("no such record")


@register_tool("test_sleeps", "sleeps", {"seconds": "how long"})
def _sleeps(ctx, seconds):
  time.sleep(float(seconds))
  return "awake"


environments.register_environment(environments.Environment(
    name="test_faulty", tools=("test_raises", "test_sleeps", "python"),
    make_tasks=lambda size, seed: [{"prompt": f"task {i}", "env_task": {"answer": 7}}
                                   for i in range(size)],
    verify=lambda task, answer: float(answer == str(task["answer"])),
    demonstrate=lambda task: [calls.render_call("test_sleeps", {"seconds": 0}), "Answer: 7"],
    instructions="Test.", rubric="Any."))


def run_scripted(entries, turns, *, max_new_tokens=512, max_turns=4, max_tool_tokens=160,
                 waves=2, timeout_s=5.0):
  runner = calls.ToolRunner(workers=4, timeout_s=timeout_s)
  rollout = ToolRollout(TOKENIZER, ToolRolloutConfig(
      max_new_tokens=max_new_tokens, max_turns=max_turns, max_tool_tokens=max_tool_tokens,
      waves=waves), runner)
  prompts = [environments.encode_prompt(e, TOKENIZER) for e in entries]
  policy = DemonstrationPolicy(TOKENIZER, dict(enumerate(turns)), logp=SCRIPT_LOGP)
  try:
    traj, infos = rollout.run(prompts, entries, policy, group_id=np.arange(len(entries)))
  finally:
    runner.close()
  return traj, infos, policy


def tool_segments(traj, row):
  """Decoded runs of response_mask 0 between policy tokens (the tool results)."""
  mask = np.asarray(traj.response_mask)[row].astype(bool)
  start, end = int(traj.prompt_lens[row]), np.flatnonzero(mask).max() + 1
  runs, current = [], []
  for t in range(start, end):
    if mask[t] and current:
      runs.append(TOKENIZER.decode(current, skip_special=False))
      current = []
    elif not mask[t]:
      current.append(int(traj.tokens[row, t]))
  return runs


# ----------------------------------------------------------------------------- Format

def test_call_format_round_trip_and_malformed_calls():
  text = "<think>plan</think>" + calls.render_call("find_hotels", {"city": "Rome"})
  assert calls.parse_call(text) == calls.ToolCall("find_hotels", {"city": "Rome"})
  ctx = calls.ToolContext({}, timeout_s=1.0)
  for bad, message in [("<tool_call>{not json}</tool_call>", "not valid JSON"),
                       ('<tool_call>["x"]</tool_call>', "JSON object"),
                       ("no start</tool_call>", "without <tool_call>"),
                       ('<tool_call>{"name": "nope"}</tool_call>', "unknown tool 'nope'"),
                       (calls.render_call("find_hotels", {"town": "Rome"}), "bad arguments")]:
    result = calls.execute(bad, ("find_hotels",), ctx)
    assert result.error and result.text.startswith("error: ") and message in result.text, (
        bad, result)
  # Byte tokenizer: stop on the marker's last byte; the host checks the whole marker.
  assert calls.call_stop_id(TOKENIZER) == TOKENIZER.encode(">")[0]
  # A tokenizer with `</tool_call>` as one added token stops on it; one without is refused.
  hf_like = types.SimpleNamespace(token_to_id={"</tool_call>": 151658}.get)
  assert calls.call_stop_id(hf_like) == 151658
  with pytest.raises(ValueError, match="no single token"):
    calls.call_stop_id(types.SimpleNamespace(token_to_id=lambda token: None))


# ----------------------------------------------------------------------------- Context rule

def test_reasoning_kept_across_tool_results_dropped_at_new_user_message():
  call = calls.render_call("python", {"code": "print(1)"})
  messages = [
      {"role": "user", "content": "q1"},
      {"role": "assistant", "content": "<think>first idea</think>" + call},
      {"role": "tool", "content": "1"},
      {"role": "assistant", "content": "<think>use the result</think>Answer: 1"},
  ]
  assert context.visible_messages(messages) == messages  # one user turn: all reasoning kept
  later = context.visible_messages(messages + [{"role": "user", "content": "q2"}])
  assert later[1]["content"] == call and later[2]["content"] == "1"
  assert later[3]["content"] == "Answer: 1"

  def seg(role, text):
    return context.Segment(role, TOKENIZER.encode(text))
  segments = [seg("prompt", "q1"), seg("assistant", "<think>a</think>" + call),
              seg("tool", calls.render_result("1")), seg("assistant", "<think>b</think>ok")]
  kept = TOKENIZER.decode(context.visible_ids(segments, TOKENIZER), skip_special=False)
  assert kept == "q1<think>a</think>" + call + calls.render_result("1") + "<think>b</think>ok"
  segments += [seg("user", "q2"), seg("assistant", "<think>c</think>")]
  dropped = TOKENIZER.decode(context.visible_ids(segments, TOKENIZER), skip_special=False)
  assert dropped == "q1" + call + calls.render_result("1") + "okq2<think>c</think>"
  # A turn cut off mid-thought keeps its unclosed reasoning.
  assert context.strip_reasoning_ids([5, 9, 9], 5, 6) == [5, 9, 9]
  # Tokenizers without single-id think markers drop the reasoning through the text.
  textual = types.SimpleNamespace(token_to_id=lambda token: None, encode=TOKENIZER.encode,
                                  decode=TOKENIZER.decode)
  assert context.visible_ids(segments, textual) == context.visible_ids(segments, TOKENIZER)


# ----------------------------------------------------------------------------- Rollout

def test_scripted_policy_solves_both_environments_with_tool_tokens_masked():
  entries = environments.make_entries(["trip_planning", "code_math"], 4, seed=3)
  if sandbox.bwrap_path() is None:
    entries = [e for e in entries if e["env"] == "trip_planning"]
  turns = [environments.demonstration(e) for e in entries]
  traj, infos, policy = run_scripted(entries, turns)
  scored = reward.score_episodes(traj, [{**e, "episode": i} for e, i in zip(entries, infos)],
                                 TOKENIZER)
  np.testing.assert_array_equal(scored["acc"], 1.0)
  mask = np.asarray(traj.response_mask).astype(bool)
  for row, (entry, info) in enumerate(zip(entries, infos)):
    assert info == {**info, "end": "answer", "tool_calls": len(turns[row]) - 1,
                    "turns": len(turns[row]), "tool_errors": 0}
    # Policy tokens are exactly the scripted turns; everything else in the episode is tool
    # output, with response_mask 0 and logp_old 0.
    policy_text = TOKENIZER.decode(traj.tokens[row][mask[row]], skip_special=False)
    assert policy_text == "".join(turns[row]) + "<|im_end|>"
    results = tool_segments(traj, row)
    assert len(results) == info["tool_calls"]
    assert all(r.startswith(calls.RESULT_PREFIX) and r.endswith(calls.RESULT_SUFFIX)
               and "error" not in r for r in results)
    np.testing.assert_array_equal(np.asarray(traj.logp_old)[row][~mask[row]], 0.0)
    np.testing.assert_array_equal(np.asarray(traj.logp_old)[row][mask[row]], SCRIPT_LOGP)
    if entry["env"] == "code_math":  # the sandboxed program printed the answer
      assert str(entry["env_task"]["answer"]) in results[0]
  assert traj.finished.all() and not traj.truncated.any()
  metrics = reward.episode_metrics(scored)
  assert metrics["tools/trip_planning/success"] == 1.0
  assert metrics["tools/trip_planning/turns"] == 4.0


def test_failing_and_slow_tools_become_error_messages():
  entry = environments.make_entries(["test_faulty"], 1, seed=0)[0]
  turns = [calls.render_call("test_raises", {}),
           calls.render_call("test_sleeps", {"seconds": 3}),
           "<tool_call>{broken</tool_call>",
           "Answer: 7"]
  start = time.monotonic()
  traj, infos, _ = run_scripted([entry], [turns], timeout_s=0.2)
  assert time.monotonic() - start < 2.5  # the slow tool was abandoned at its deadline
  assert infos[0]["end"] == "answer" and infos[0]["tool_errors"] == 3
  raised, slow, broken = tool_segments(traj, 0)
  assert "test_raises raised KeyError" in raised
  assert "timed out after 0.2 s" in slow
  assert "malformed tool call" in broken


@needs_bwrap
def test_python_tool_errors_and_timeouts_reach_the_model():
  entry = environments.make_entries(["test_faulty"], 1, seed=0)[0]
  turns = [calls.render_call("python", {"code": "1 / 0"}),
           calls.render_call("python", {"code": "while True: pass"}),
           calls.render_call("python", {"code": "print(6 * 7)"}), "Answer: 7"]
  traj, infos, _ = run_scripted([entry], [turns], timeout_s=1.0, max_tool_tokens=200)
  failed, looped, ok = tool_segments(traj, 0)
  assert "ZeroDivisionError" in failed
  assert "stopped (timeout" in looped or "timed out" in looped
  assert "42" in ok and infos[0]["tool_errors"] == 2 and infos[0]["end"] == "answer"


def test_turn_limit_and_token_budget_end_episodes_cleanly():
  entries = environments.make_entries(["trip_planning"], 3, seed=1)
  task = entries[0]["env_task"]
  call = calls.render_call("find_hotels", {"city": task["destination"], "min_rating": 1})
  turns = [[call] * 10, [call] * 10, ["<think>" + "y" * 600]]
  traj, infos, _ = run_scripted(entries, turns, max_new_tokens=512, max_turns=2)
  assert [i["end"] for i in infos] == ["turn_limit", "turn_limit", "length"]
  assert infos[0]["tool_calls"] == 2 and infos[0]["turns"] == 2
  assert len(tool_segments(traj, 0)) == 2
  lengths = np.asarray(traj.response_mask).sum(-1)
  assert lengths[0] == 3 * len(TOKENIZER.encode(call)) and lengths[2] == 512
  assert not traj.finished.any() and traj.truncated.tolist() == [False, False, True]
  prompt_width = round_up(int(traj.prompt_lens.max()), 16)
  assert traj.tokens.shape[1] == prompt_width + 512 + 2 * 160


def test_greater_than_sign_in_text_is_not_a_tool_call():
  """The byte tokenizer pauses at every `>`; only the full marker makes a call. The resumed
  episode continues at the right RNG index (the scripted stream position)."""
  entry = environments.make_entries(["test_faulty"], 1, seed=0)[0]
  turns = [["if 3 > 2 then a -> b. Answer: 7"]]
  traj, infos, policy = run_scripted([entry], turns)
  assert infos[0] == {**infos[0], "end": "answer", "tool_calls": 0, "turns": 1}
  assert policy.rounds == 3  # paused at both `>` signs, resumed each time
  mask = np.asarray(traj.response_mask)[0].astype(bool)
  assert TOKENIZER.decode(traj.tokens[0][mask]) == turns[0][0]


@pytest.fixture(scope="module")
def tiny_model():
  """The smallest LM, with room for tool episodes (policy of the engine test, and judge)."""
  return Transformer(get_model_config("tiny_dense", max_seq_len=2048), rngs=nnx.Rngs(params=0))


def test_engine_pauses_and_resumes_without_changing_the_samples(tiny_model):
  """The real engine: pausing episodes at a frequent token and resuming them from a fresh
  prefill (RNG index = tokens so far) samples the same tokens with the same log-probs."""
  graphdef, state = nnx.split(tiny_model)
  entries = environments.make_entries(["test_faulty"], 4, seed=0)
  prompts = [environments.encode_prompt(e, TOKENIZER) for e in entries]
  engine_cfg = RolloutConfig(max_new_tokens=48, stop_ids=TOKENIZER.stop_ids, prompt_bucket=16)
  runner = calls.ToolRunner(workers=2, timeout_s=1.0)

  def run(stop_id):
    rollout = ToolRollout(TOKENIZER, ToolRolloutConfig(
        max_new_tokens=48, max_turns=1, max_tool_tokens=64, waves=2), runner)
    rollout.call_stop_id = stop_id
    engine = rollout.engine_generate(graphdef, state, jax.random.key(1), engine_cfg,
                                     rollout.wave_rows(len(prompts)))
    rounds = []

    def generate(*args):
      rounds.append(len(args[0]))
      return engine(*args)
    traj, _ = rollout.run(prompts, entries, generate, group_id=np.arange(4))
    return traj, len(rounds)
  whole, whole_rounds = run(-1)
  mask = np.asarray(whole.response_mask).astype(bool)
  sampled = np.asarray(whole.tokens)[mask]
  counts = np.bincount(sampled, minlength=max(TOKENIZER.stop_ids) + 1)
  counts[list(TOKENIZER.stop_ids)] = 0  # pausing at a final stop id would end the episode instead
  paused, paused_rounds = run(int(counts.argmax()))
  runner.close()
  assert paused_rounds > whole_rounds == 2  # one round per wave, then the resumed ones
  np.testing.assert_array_equal(paused.tokens, whole.tokens)
  np.testing.assert_array_equal(paused.response_mask, whole.response_mask)
  np.testing.assert_allclose(paused.logp_old, whole.logp_old, atol=1e-4)


def test_reward_mixes_verifier_with_rubric_judge(tiny_model):
  entries = environments.make_entries(["test_faulty"], 2, seed=0)
  turns = [[calls.render_call("test_sleeps", {"seconds": 0}), "Answer: 7"], ["Answer: 8"]]
  traj, infos, _ = run_scripted(entries, turns, max_new_tokens=128, max_turns=1,
                                max_tool_tokens=64)
  rows = [{**e, "episode": i} for e, i in zip(entries, infos)]
  judge = GenerativeRM(tiny_model, TOKENIZER, length_multiple=64)
  scored = reward.score_episodes(traj, rows, TOKENIZER, judge=judge, judge_weight=0.25)
  np.testing.assert_array_equal(scored["acc"], [1.0, 0.0])
  assert ((scored["judge"] > 0) & (scored["judge"] < 1)).all()
  np.testing.assert_allclose(scored["reward"], 0.75 * scored["acc"] + 0.25 * scored["judge"],
                             rtol=1e-6)
  transcript = TOKENIZER.decode(traj.tokens[1, traj.prompt_lens[1]:])
  assert transcript == "Answer: 8"
  expected = judge.p_yes([reward.rubric_prompt("Any.", entries[1]["prompt"], transcript)])
  np.testing.assert_allclose(scored["judge"][1], expected[0], rtol=1e-6)
  assert scored["tool_calls"].tolist() == [1.0, 0.0] and scored["turns"].tolist() == [2.0, 1.0]


@pytest.mark.slow
def test_warm_start_fits_expert_transcripts(tiny_model):
  """Demonstrations replayed through the rollout (tools really run) are SFT data whose loss
  covers assistant tokens only; a few steps lower it."""
  entries = environments.make_entries(["test_faulty"], 4, seed=2)
  runner = calls.ToolRunner(workers=2, timeout_s=1.0)
  rollout = ToolRollout(TOKENIZER, ToolRolloutConfig(max_new_tokens=96, max_turns=1,
                                                     max_tool_tokens=64), runner)
  prompts = [environments.encode_prompt(e, TOKENIZER) for e in entries]
  traj, infos = demonstrations.transcripts(rollout, prompts, entries)
  runner.close()
  assert [i["tool_calls"] for i in infos] == [1] * 4 and all(i["end"] == "answer" for i in infos)
  assert all("awake" in r for row in range(4) for r in tool_segments(traj, row))
  graphdef, params, rest = nnx.split(tiny_model, nnx.Param, ...)
  _, losses = demonstrations.warm_start(graphdef, params, rest, [traj], steps=6,
                                          optimizer=optax.adam(1e-2))
  assert losses[-1] < 0.8 * losses[0]


# ----------------------------------------------------------------------------- No gradient

class _FixedLogits(nnx.Module):
  """A stand-in policy whose logits are its parameter, so d loss / d params = d loss / d
  logits through the real `policy_objective`."""

  def __init__(self, logits):
    self.logits = nnx.Param(logits)

  def forward(self, tokens, routing=None, token_mask=None, indexer_stage=None):
    return types.SimpleNamespace(logits=self.logits.value, router_stats=None)


def test_tool_result_positions_get_no_gradient():
  entries = environments.make_entries(["test_faulty"], 2, seed=5)
  turns = [["<think>a</think>" + calls.render_call("test_sleeps", {"seconds": 0}),
            "<think>b</think>" + calls.render_call("test_raises", {}), "Answer: 7"]] * 2
  traj, infos, _ = run_scripted(entries, turns, max_new_tokens=128, max_turns=2,
                                max_tool_tokens=64)
  config = tool_config()
  advs = {"advantages": np.asarray(traj.response_mask, np.float32) * np.array([[1.0], [-1.0]])}
  batch = build_batch(traj, {"acc": np.ones(2, np.float32)}, advs, config.rl)
  mask = batch["response_mask"].astype(bool)
  last = np.array([np.flatnonzero(m).max() for m in mask])
  # The whole episode is attended, tool results in the middle included.
  np.testing.assert_array_equal(batch["attention_mask"].sum(-1), last + 1)
  logits = jax.random.normal(jax.random.key(0), (*batch["tokens"].shape, TOKENIZER.vocab_size))
  graphdef, params, rest = nnx.split(_FixedLogits(logits), nnx.Param, ...)
  rl = dict(algorithms.recipe("dapo"), indexer_coef=0.0)
  jbatch = {k: jnp.asarray(v) for k, v in batch.items()}
  counts = dict(ts.global_counts(jbatch, rl), micro_batches=jnp.ones(()))
  grads = jax.grad(lambda p: ts.policy_objective(p, graphdef, rest, jbatch, counts, rl=rl,
                                                 temperature=1.0, max_len=128)[0])(params)
  grad_logits = np.asarray(grads["logits"].value)  # [B, T, V]; position t predicts token t+1
  predicts_tool = np.zeros_like(mask)
  predicts_tool[:, :-1] = ~mask[:, 1:]
  assert np.abs(grad_logits[predicts_tool]).max() == 0.0
  assert np.abs(grad_logits[~predicts_tool]).max() > 0.0
  # Tool tokens sit strictly inside the episodes (before the last policy token).
  assert all((~mask[b, traj.prompt_lens[b]:last[b]]).sum() > 0 for b in range(2))


# ----------------------------------------------------------------------------- RL end to end

def tool_config(*, demo_model: bool = False, **overrides) -> ml_collections.ConfigDict:
  """The tool demo shrunk to seconds: trip planning, 2 prompts x 2 episodes, 2 steps, no warm
  start; the smallest dense model and Dr. GRPO (no reference model) unless `demo_model`."""
  c = ml_collections.ConfigDict(tool_demo.get_config("trip_planning").to_dict())
  if not demo_model:
    c.model = model_section("tiny_dense", max_seq_len=1024)
    c.rl = algorithms.recipe("dr_grpo")
  c.data.train_size = 8
  c.data.heldout_size = 4
  c.rollout.max_new_tokens = 16
  c.tools.max_turns = 2
  c.tools.max_tool_tokens = 160
  c.tools.warm_start_steps = 0
  c.train.steps = 2
  c.train.prompts_per_step = 2
  c.train.samples_per_prompt = 2
  c.train.eval_every = 2
  c.train.checkpoint_every = 2
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (c[section] if section else c)[field] = value
  validate(c)
  return c


def test_config_validation_names_tool_fields():
  for overrides, field in [({"tools.environments": "nowhere"}, "tools.environments"),
                           ({"tools.environments": ""}, "tools.environments"),
                           ({"tools.max_turns": 0}, "tools.max_turns"),
                           ({"tools.judge_weight": 0.5}, "tools.judge_hf_dir"),
                           ({"job": "sft"}, "tools.enabled")]:
    with pytest.raises(ValueError, match=field):
      tool_config(**overrides)
  for arg in ("", "code_math"):
    validate(tool_demo.get_config(arg))


def check_tool_run(workdir: str, last: dict) -> None:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  assert [r["step"] for r in rows] == [1, 2]
  for key in ("success", "turns", "tool_calls", "tool_errors", "turn_limit_rate"):
    assert f"tools/trip_planning/{key}" in last
  assert np.isfinite(last["loss"]) and last["skipped"] == 0.0
  assert 0.0 <= last["heldout_acc"] <= 1.0
  # The first update of fresh episodes is on-policy: trainer log-probs equal the sampler's.
  assert abs(rows[0]["approx_kl"]) < 1e-4


def test_tool_rl_steps_end_to_end(tmp_path):
  """Two Dr. GRPO steps of the smallest model on tool episodes: rollout, verifier reward,
  update, a held-out evaluation and per-environment metrics."""
  check_tool_run(str(tmp_path), Trainer(tool_config(), str(tmp_path)).run())


@pytest.mark.slow
def test_tool_demo_model_rl_steps(tmp_path):
  """The demo's MoE + MLA + DSA policy under DeepSeek-V3.2 GRPO (unbiased KL, off-policy
  masking, keep-routing and keep-sampling-mask recorded across turns), after a two-step warm
  start on expert transcripts."""
  config = tool_config(demo_model=True, **{"tools.warm_start_steps": 2, "sft.batch_size": 2})
  check_tool_run(str(tmp_path), Trainer(config, str(tmp_path)).run())
