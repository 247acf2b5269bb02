"""Tests of benchmark evaluation (rl/jobs/evaluation.py, launch/eval.py): the unbiased pass@k
estimator against hand-computed values and exact binomials, majority voting, answer and code
extraction and grading, dataset loading errors, restoring our SFT / RL orbax checkpoints, and
end-to-end runs of the launcher on a tiny random HF checkpoint (GSM8K, HumanEval in the sandbox)
and on an RL checkpoint of the demo config."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from models.padding import round_up
from rl.jobs import evaluation
from rl.rewards import code as code_reward
from rl.rewards import manager, sandbox

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
HAS_DATA = os.path.isdir(evaluation.DEFAULT_DATA_DIR)
needs_data = pytest.mark.skipif(not HAS_DATA,
                                reason=f"{evaluation.DEFAULT_DATA_DIR} (eval data) is missing")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")


# ======================================================================== pass@k and maj@k

@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),  # c / n
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),  # n - c < k: every draw of 4 holds a correct sample
    (5, 0, 3, 0.0),
    (5, 5, 1, 1.0),
    (1, 1, 1, 1.0),
    (1, 0, 1, 0.0),
    (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
])
def test_pass_at_k_hand_computed(n, c, k, expected):
  """pass@k equals 1 - C(n-c, k)/C(n, k) worked out by hand, including the edge cases."""
  assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_exact_binomials_and_is_stable():
  """The product form equals exact integer binomials for all small (n, c, k), grows with k and
  c, and stays finite where C(n, k) overflows a float (n = 2000)."""
  for n in range(1, 13):
    for c in range(n + 1):
      values = [evaluation.pass_at_k(n, c, k) for k in range(1, n + 1)]
      for k, value in zip(range(1, n + 1), values):
        assert value == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)
      assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
  assert math.comb(2000, 1000) > 1e308  # the naive ratio of floats would be inf / inf
  value = evaluation.pass_at_k(2000, 3, 1000)
  assert value == pytest.approx(1 - math.comb(1997, 1000) / math.comb(2000, 1000), rel=1e-12)
  assert evaluation.pass_at_k(2000, 1, 1) == pytest.approx(1 / 2000)


def test_pass_at_k_rejects_bad_counts():
  """c outside [0, n] and k outside [1, n] are errors, not silently clipped."""
  for n, c, k in [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)]:
    with pytest.raises(ValueError):
      evaluation.pass_at_k(n, c, k)


def test_majority_vote():
  """The most frequent answer decides; None does not vote; a tie goes to the first seen; no
  answers at all score 0."""
  majority = evaluation.majority_correct
  assert majority(["4", "5", "4", None, None, None], [1, 0, 1, 0, 0, 0]) == 1.0
  assert majority(["5", "4", "5", "4", "4"], [0, 1, 0, 1, 1]) == 1.0
  assert majority(["5", "5", "4"], [0, 0, 1]) == 0.0
  assert majority(["7", "4", "4", "7"], [0, 1, 1, 0]) == 0.0  # tie: "7" came first
  assert majority([None, None], [0, 0]) == 0.0
  with pytest.raises(ValueError):
    majority(["1"], [1, 0])


def test_summarize_on_constructed_grades():
  """Dataset metrics: pass@k averaged over problems, avg@n over samples, maj@n over problems,
  maj@n omitted for code (answers=None)."""
  correct = np.array([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], float)
  answers = [["3", "2", "2", "2"], ["9", "9", "9", "8"], [None, "1", "1", "2"]]
  lengths = np.array([[10, 20, 30, 40]] * 3)
  truncated = np.zeros((3, 4), bool)
  truncated[0, 0] = True
  m = evaluation.summarize(correct, lengths, truncated, answers)
  assert sorted(m) == sorted(["pass@1", "pass@2", "pass@4", "avg@4", "maj@4",
                              "response_len_mean", "truncated_fraction"])
  assert m["pass@1"] == pytest.approx((0.25 + 0.75 + 0) / 3)
  assert m["pass@2"] == pytest.approx((0.5 + 1.0 + 0) / 3)  # 1 - C(3,2)/C(4,2) = 0.5
  assert m["pass@4"] == pytest.approx(2 / 3)
  assert m["avg@4"] == pytest.approx(4 / 12)
  assert m["maj@4"] == pytest.approx(1 / 3)  # only problem 2's majority ("9") is right
  assert m["response_len_mean"] == 25.0 and m["truncated_fraction"] == pytest.approx(1 / 12)
  assert "maj@4" not in evaluation.summarize(correct, lengths, truncated, None)
  assert evaluation.k_values(8) == [1, 2, 4, 8] and evaluation.k_values(6) == [1, 2, 4, 6]


# ======================================================================== Extraction, data

def test_vote_keys_grades_and_code_extraction():
  """Math votes go to normalised boxed answers (so 1,000 and 1000 agree) and grade against the
  gold; a puzzle's gold answer grades right; a plain HumanEval completion stops where the
  function body ends; chat responses give their code block."""
  gsm = evaluation.Problem(id="g", kind="math", question="q", gold="1000")
  assert evaluation.vote_key(gsm, "so \\boxed{1,000}.") == evaluation.vote_key(gsm, "is 1000")
  assert evaluation.vote_key(gsm, "no digits here") is None
  assert evaluation.grade([gsm, gsm], ["so \\boxed{1,000}.", "\\boxed{999}"],
                          template="plain") == [1.0, 0.0]
  puzzle = evaluation.load_problems("arithmetic", puzzle_size=3, limit=1)[0]
  assert evaluation.grade([puzzle] * 2, [f"Answer: {puzzle.gold_answer}", "Answer: x"],
                          template="plain") == [1.0, 0.0]
  gold = code_reward.CodeProblem(tests=(code_reward.AssertTest("assert f()"),),
                                 prefix="def f():\n")
  code = evaluation.Problem(id="h", kind="code", question="def f():\n", gold=gold)
  assert evaluation.vote_key(code, "return 1") is None
  completion = "  return 1\n\ndef helper():\n  pass\nprint(f())"
  assert manager.program_of(code.record("plain"), completion) == "  return 1\n"
  chat = "Sure:\n```python\ndef f():\n  return 2\n```\nDone."
  assert manager.program_of(code.record("chat"), chat) == "\ndef f():\n  return 2\n"


@needs_data
def test_dataset_fields_and_golds():
  """Every math set loads with its question and a gold answer; GSM8K's gold is the number after
  '####', AMC's float 27.0 becomes '27', AIME's zero padding is kept for the verifier."""
  sizes = {"gsm8k": 1319, "math500": 500, "aime24": 30, "aime25": 30, "amc23": 40}
  for name, size in sizes.items():
    problems = evaluation.load_problems(name)
    assert len(problems) == size and all(p.question and p.gold for p in problems)
  assert evaluation.load_problems("gsm8k", limit=1)[0].gold == "18"
  assert evaluation.load_problems("amc23", limit=1)[0].gold == "27"
  assert len(evaluation.load_problems("humaneval", limit=10)) == 10
  puzzles = evaluation.load_problems("arithmetic", puzzle_size=20, limit=5)
  assert len(puzzles) == 5 and puzzles[0].kind == "puzzle"


def test_unknown_dataset_and_missing_data_dir(tmp_path):
  """An unknown name lists the known ones; a missing file names its path."""
  with pytest.raises(ValueError, match="unknown dataset 'gsm9k'.*gsm8k.*humaneval.*arithmetic"):
    evaluation.load_problems("gsm9k")
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "gsm8k_test.jsonl")):
    evaluation.load_problems("gsm8k", data_dir=str(tmp_path))


# ======================================================================== End to end

def _run_eval(*args: str, timeout: float = 240, devices: int = 1
              ) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, os.path.join(REPO, "launch", "eval.py"), *args],
                        capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny random qwen2 checkpoint with a byte-level BPE tokenizer trained on a few lines."""
  from models import hf
  from models.transformer import build
  root = tmp_path_factory.mktemp("tiny_qwen2")
  texts = ["Janet's ducks lay 16 eggs per day. How much in dollars does she make?",
           "def add(a, b):\n    return a + b\n", "Please reason step by step."] * 20
  from tiny_hf import train_bpe_tokenizer
  size = train_bpe_tokenizer(root, texts, 400, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                             chat_template=CHATML)
  vocab = round_up(size, 8)
  model = build("tiny_dense", seed=0, vocab_size=vocab, max_seq_len=1024)
  hf.save_pretrained(model, str(root / "model"), dtype="float32", tokenizer_dir=str(root))
  return str(root / "model")


@pytest.fixture(scope="module")
def hf_run(hf_dir, tmp_path_factory):
  """One launcher run: GSM8K's first 50 problems and (with bubblewrap) HumanEval's first 10,
  2 samples each, 16 new tokens."""
  if not HAS_DATA:
    pytest.skip(f"{evaluation.DEFAULT_DATA_DIR} (eval data) is missing")
  datasets = "gsm8k:50,humaneval:10" if sandbox.bwrap_path() else "gsm8k:50"
  out_dir = str(tmp_path_factory.mktemp("eval_out"))
  proc = _run_eval(f"--hf_dir={hf_dir}", f"--dataset={datasets}", "--k=2",
                   "--max_new_tokens=16", "--temperature=1.0", "--top_p=1.0", "--dtype=float32",
                   "--batch_size=25", f"--out_dir={out_dir}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(os.path.join(out_dir, "results.json")) as f:
    results = json.load(f)
  with open(os.path.join(out_dir, "samples.jsonl")) as f:
    samples = [json.loads(line) for line in f]
  with open(os.path.join(out_dir, "results.md")) as f:
    table = f.read()
  return results, samples, table, proc


def test_gsm8k_end_to_end(hf_run):
  """50 GSM8K problems x 2 samples: metrics with the expected keys and ranges, 100 graded
  samples of at most 16 tokens, the table written and printed, progress lines logged."""
  results, samples, table, proc = hf_run
  gsm = results["datasets"]["gsm8k"]
  assert gsm["num_problems"] == 50 and gsm["limit"] == 50
  assert sorted(gsm["metrics"]) == sorted(["pass@1", "pass@2", "avg@2", "maj@2",
                                           "response_len_mean", "truncated_fraction"])
  assert all(0.0 <= gsm["metrics"][k] <= 1.0 for k in ("pass@1", "pass@2", "avg@2", "maj@2"))
  assert gsm["metrics"]["pass@1"] == pytest.approx(gsm["metrics"]["avg@2"])
  assert 1 <= gsm["metrics"]["response_len_mean"] <= 16
  rows = [s for s in samples if s["dataset"] == "gsm8k"]
  assert len(rows) == 100 and len({s["id"] for s in rows}) == 50
  assert all(s["length"] <= 16 and s["correct"] in (0.0, 1.0) for s in rows)
  assert rows[0]["gold"] == "18" and [r["sample"] for r in rows[:2]] == [0, 1]
  assert np.mean([s["correct"] for s in rows]) == pytest.approx(gsm["metrics"]["avg@2"])
  assert results["settings"]["k"] == 2 and results["settings"]["max_new_tokens"] == 16
  assert "| dataset | problems | pass@1 | pass@2 | avg@2 | maj@2 |" in table
  assert "| gsm8k | 50 |" in table and "| gsm8k | 50 |" in proc.stdout
  assert "[gsm8k] 25/50 problems" in proc.stderr and "[gsm8k] 50/50 problems" in proc.stderr


@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap (bwrap) is not installed")
def test_humaneval_end_to_end(hf_run):
  """10 HumanEval problems x 2 samples graded in the sandbox: pass@k and avg@k but no maj@k,
  "-" in the table's maj column, 20 samples with HumanEval task ids."""
  results, samples, table, _ = hf_run
  human = results["datasets"]["humaneval"]
  assert human["num_problems"] == 10
  assert sorted(human["metrics"]) == sorted(["pass@1", "pass@2", "avg@2",
                                             "response_len_mean", "truncated_fraction"])
  rows = [s for s in samples if s["dataset"] == "humaneval"]
  assert len(rows) == 20
  assert [r["id"] for r in rows[::2]] == [f"HumanEval/{i}" for i in range(10)]
  assert all(r["answer"] is None and r["correct"] in (0.0, 1.0) for r in rows)
  humaneval_row = next(line for line in table.splitlines() if line.startswith("| humaneval |"))
  assert humaneval_row.split("|")[6].strip() == "-"


def test_cli_reports_bad_paths_and_names(hf_dir, tmp_path):
  """A missing --hf_dir, an unknown dataset and a missing --data_dir each exit with status 2
  and a one-line message naming the culprit."""
  proc = _run_eval(f"--hf_dir={tmp_path / 'nope'}", "--dataset=gsm8k")
  assert proc.returncode == 2 and f"--hf_dir={tmp_path / 'nope'}: no config.json" in proc.stderr
  proc = _run_eval(f"--hf_dir={hf_dir}", "--dataset=gsm8k,gsm9k", f"--data_dir={tmp_path}")
  assert proc.returncode == 2 and "unknown dataset 'gsm9k'" in proc.stderr
  proc = _run_eval(f"--hf_dir={hf_dir}", "--dataset=aime24", f"--data_dir={tmp_path / 'x'}")
  assert proc.returncode == 2 and f"--data_dir={tmp_path / 'x'} does not exist" in proc.stderr


# ======================================================================== Our checkpoints

@pytest.fixture(scope="module")
def orbax_checkpoints(tmp_path_factory):
  """An SFT-style {"params"} and an RL-style {"policy": TrainState, "rest"} checkpoint of the
  demo config's model, holding random values unlike any initialisation."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from configs import demo
  from models.transformer import Transformer
  from rl.core.policy import model_config
  from rl.core import train_step
  from rl.jobs.checkpoint import Checkpointer
  config = demo.get_config()
  root = tmp_path_factory.mktemp("orbax")
  abstract = nnx.eval_shape(lambda: Transformer(model_config(config),
                                                rngs=nnx.Rngs(params=config.seed)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  rng = np.random.default_rng(7)
  params, rest = jax.tree.map(
      lambda x: jnp.asarray(rng.standard_normal(x.shape) * 0.05, x.dtype), (params, rest))
  sft = Checkpointer(str(root / "sft" / "checkpoints"))
  sft.save(4, {"params": params}, {"step": 4}, force=True)  # as SFT wrote them before biases
  sft.save(9, {"params": params, "rest": rest}, {"step": 9}, force=True)
  sft.close()
  optimizer = train_step.make_optimizer(lr=1e-3, warmup_steps=1, weight_decay=0.0,
                                        grad_clip=1.0)
  rl = Checkpointer(str(root / "rl"))
  rl.save(3, {"policy": train_step.init_state(params, optimizer), "rest": rest}, {"step": 3},
          force=True)
  rl.close()
  return config, root, _leaves(nnx.merge(graphdef, params, rest))


def _leaves(model) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """The model's parameter values and its other variables' values."""
  import jax
  from flax import nnx
  _, params, rest = nnx.split(model, nnx.Param, ...)
  return ([np.asarray(x) for x in jax.tree.leaves(params)],
          [np.asarray(x) for x in jax.tree.leaves(rest)])


def test_load_policy_checkpoint_sft_and_rl(orbax_checkpoints):
  """Both checkpoint kinds restore exactly the saved parameters (not the config's fresh init)
  and their rest (router biases; an older SFT state without them keeps the initial zeros): the
  latest step by default, a
  named step, a workdir holding checkpoints/; a missing step is an error listing the steps, a
  missing or empty directory an error naming it."""
  config, root, (saved_params, saved_rest) = orbax_checkpoints
  for directory, step, expected_step in [(root / "sft", None, 9), (root / "sft", 4, 4),
                                         (root / "rl", None, 3)]:
    model, got_step = evaluation.load_policy_checkpoint(config, str(directory), step)
    assert got_step == expected_step
    params, rest = _leaves(model)
    assert len(params) == len(saved_params) > 10 and len(rest) == len(saved_rest) > 0
    for got, want in zip(params, saved_params):
      np.testing.assert_array_equal(got, want)
    for got, want in zip(rest, saved_rest):
      np.testing.assert_array_equal(got, 0 * want if step == 4 else want)
  with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 5 \(steps: \[4, 9\]\)"):
    evaluation.load_policy_checkpoint(config, str(root / "sft"), 5)
  with pytest.raises(FileNotFoundError, match="no such directory"):
    evaluation.load_policy_checkpoint(config, str(root / "nope"))
  (root / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match="empty holds no checkpoint$"):
    evaluation.load_policy_checkpoint(config, str(root / "empty"))


def test_orbax_checkpoint_end_to_end(orbax_checkpoints, tmp_path):
  """The launcher on an RL checkpoint with the demo config: the trainer's held-out addition
  problems (first 8, k=2), maj@2 reported, the step recorded."""
  _, root, _ = orbax_checkpoints
  proc = _run_eval("--config=configs/demo.py", f"--checkpoint={root / 'rl'}",
                   "--dataset=addition:8", "--k=2", "--max_new_tokens=8",
                   f"--out_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  assert results["model"]["step"] == 3 and results["settings"]["template"] == "plain"
  addition = results["datasets"]["addition"]
  assert addition["num_problems"] == 8 and "maj@2" in addition["metrics"]
  with open(tmp_path / "samples.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert len(rows) == 16 and all(r["length"] <= 8 for r in rows)
  assert rows[0]["gold"] is not None


def test_default_out_dirs_of_a_pipelines_sft_and_rl_checkpoints_differ():
  """launch/eval.py without --out_dir: the SFT and RL checkpoints of one pipeline run (given as
  their checkpoints/ folders or as the stage folders holding them) and a named step get
  folders of their own, so one evaluation does not overwrite another's results; an HF
  directory keeps its name. (A subprocess: launch/eval.py defines absl flags that other
  launchers imported by tests define too.)"""
  cases = [("", "workdir/demo/sft/checkpoints", None), ("", "workdir/demo/rl/checkpoints", None),
           ("", "workdir/demo/rl", None), ("", "workdir/demo/rl/checkpoints/", 25),
           ("/ckpt/Qwen2.5-Math-1.5B", "", None)]
  code = ("import json, sys; from launch import eval as e; "
          f"print(json.dumps([e.default_out_dir(*case) for case in {cases!r}]))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(proc.stdout) == ["eval/demo_sft", "eval/demo_rl", "eval/demo_rl",
                                     "eval/demo_rl_step25", "eval/Qwen2.5-Math-1.5B"]


def test_sharded_evaluation_equals_single_device(orbax_checkpoints):
  """The RL checkpoint restored onto an 8-device mesh (data 2 x fsdp 2 x tensor 2: parameters
  sharded, rows split) samples the responses the single-device restore samples (k=4 at
  temperature 1 on 8 addition problems), so every grade and pass@k / maj@k / length metric is
  the same. The random policy solves none, so the identical responses carry the check."""
  from models import sharding
  from models.tokenizer import load_tokenizer
  from rl.rollout import engine as rollout_lib
  config, root, _ = orbax_checkpoints
  tokenizer = load_tokenizer("byte")
  problems = evaluation.load_problems("addition", limit=8, puzzle_size=50)
  prompts = evaluation.encode_prompts(problems, tokenizer, "plain")
  cfg = rollout_lib.RolloutConfig(max_new_tokens=8, stop_ids=tokenizer.stop_ids,
                                  pad_id=tokenizer.pad_id, prompt_bucket=16)
  mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  results = []
  for on in (None, mesh):
    model, _ = evaluation.load_policy_checkpoint(config, str(root / "rl"), mesh=on)
    graphdef, state = nnx.split(model)
    samples = evaluation.evaluate(graphdef, state, problems, prompts, tokenizer, cfg,
                                  num_samples=4, batch_size=4, template="plain", mesh=on)
    results.append((samples, evaluation.summarize(samples.correct, samples.lengths,
                                                  samples.truncated, samples.answers)))
    if on is not None:
      assert sum(not v.get_value().sharding.is_fully_replicated
                 for _, v in nnx.state(model).flat_state()) > 10
  (single, single_metrics), (sharded, sharded_metrics) = results
  assert sharded.responses == single.responses
  np.testing.assert_array_equal(sharded.correct, single.correct)
  assert sharded_metrics == single_metrics and "pass@4" in sharded_metrics


def test_eval_launcher_mesh_flag(orbax_checkpoints, tmp_path):
  """launch/eval.py --mesh=fsdp=4,data=2 on 8 devices writes the samples and metrics of the
  launcher on one device, and records the mesh; a --mesh the devices cannot hold is one line."""
  _, root, _ = orbax_checkpoints
  outputs = []
  for name, devices, mesh in (("one", 1, []), ("eight", 8, ["--mesh=fsdp=4,data=2"])):
    proc = _run_eval("--config=configs/demo.py", f"--checkpoint={root / 'rl'}",
                     "--dataset=addition:4", "--k=2", "--max_new_tokens=8", "--batch_size=4",
                     f"--out_dir={tmp_path / name}", *mesh, devices=devices)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / name / "results.json").read_text())
    outputs.append((results, (tmp_path / name / "samples.jsonl").read_text()))
  (one, one_samples), (eight, eight_samples) = outputs
  assert eight_samples == one_samples
  assert eight["datasets"]["addition"]["metrics"] == one["datasets"]["addition"]["metrics"]
  assert eight["settings"]["mesh"]["fsdp"] == 4 and eight["settings"]["mesh"]["data"] == 2
  bad = _run_eval("--config=configs/demo.py", f"--checkpoint={root / 'rl'}",
                  "--dataset=addition:4", "--mesh=fsdp=3", f"--out_dir={tmp_path / 'bad'}")
  assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
      "error: --mesh=fsdp=3"), bad.stderr[-2000:]


@pytest.mark.skipif(sandbox.bwrap_path() is None, reason="bubblewrap (bwrap) is not installed")
def test_humaneval_canonical_solutions_pass():
  """The HumanEval grading path (prompt + extracted completion + check, in the sandbox) passes
  the canonical solutions and fails a wrong one: a 0 score of a random model means something."""
  problems = evaluation.load_problems("humaneval", limit=3)
  records = evaluation.humaneval_records()[:3]
  right = [r["canonical_solution"] + "\ndef unrelated():\n  pass\n" for r in records]
  assert evaluation.grade(problems, right, template="plain") == [1.0, 1.0, 1.0]
  assert evaluation.grade(problems[:1], ["    return None\n"], template="plain") == [0.0]
