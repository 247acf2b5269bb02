"""The RL loop end to end on the tiny MoE + MLA + DSA demo model with the real arithmetic
verifier: the demo pipeline (SFT cold start, then RL, results table), three steps of each
flagship recipe, on-policy ratios, dynamic sampling, and resume after a kill."""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from configs import common, demo
from rl import pipeline
from rl.trainer import Trainer
from rl.types import Trajectories


def small_config(algorithm="dapo", **overrides) -> ml_collections.ConfigDict:
  """The demo shrunk to seconds: single-digit sums, 4 prompts x 4 samples per step."""
  c = ml_collections.ConfigDict(demo.get_config(algorithm).to_dict())
  c.data.difficulty = 0
  c.data.train_size = 48
  c.data.heldout_size = 64
  c.rollout.max_new_tokens = 16
  c.sft.epochs = 60
  c.sft.batch_size = 16
  c.sft.dense_warmup_steps = 40
  c.sft.log_every = 1000
  c.train.steps = 3
  c.train.prompts_per_step = 4
  c.train.samples_per_prompt = 4
  c.train.eval_every = 0
  c.train.checkpoint_every = 1
  c.rl.critic_warmup_steps = min(c.rl.critic_warmup_steps, 1)
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (c[section] if section else c)[field] = value
  common.validate(c)
  return c


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  """The demo pipeline, shortened: SFT, held-out eval, 3 DAPO steps, table and plot."""
  workdir = str(tmp_path_factory.mktemp("demo"))
  results = pipeline.run_sft_then_rl(small_config(), workdir)
  return workdir, results


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_demo_pipeline_writes_results_table_and_curve(demo_run):
  workdir, results = demo_run
  with open(os.path.join(workdir, "results.json")) as f:
    saved = json.load(f)
  assert saved == results
  assert {"sft_heldout_acc", "rl_heldout_acc", "heldout_size", "wall_s"} <= set(saved)
  assert 0.0 <= saved["sft_heldout_acc"] <= 1.0 and saved["heldout_size"] > 0
  # The cold start taught the format: some held-out problems are already solved.
  assert saved["sft_heldout_acc"] > 0.0
  assert os.path.getsize(os.path.join(workdir, "learning_curve.png")) > 1000
  rows = read_metrics(os.path.join(workdir, "rl"))
  assert [r["step"] for r in rows] == [1, 2, 3]
  assert os.listdir(os.path.join(workdir, "rl", "tb"))


def test_first_update_on_fresh_data_is_on_policy(demo_run):
  """One epoch, one mini-batch: the trainer's log-probs equal the sampler's, so the ratio is
  1 everywhere and nothing is clipped."""
  rows = read_metrics(os.path.join(demo_run[0], "rl"))
  for r in rows:
    assert abs(r["approx_kl"]) < 1e-5, r
    assert r["clipfrac_high"] == 0.0 and r["clipfrac_low"] == 0.0, r


def test_rejection_sampling_from_the_sft_checkpoint_writes_verified_sft_data(demo_run, tmp_path):
  """The rollout engine samples N per prompt from the SFT checkpoint; exactly the responses the
  verifier accepts are written, and the file reads back as SFT examples of its responses."""
  from rl.data import rejection
  from rl import sft
  from rl.data import sources
  from rl.rewards import manager
  from models.tokenizer import load_tokenizer
  out = str(tmp_path / "rs.jsonl")
  config = small_config()
  stats = rejection.sample_and_keep(config, os.path.join(demo_run[0], "sft"), n=4,
                                    out_path=out, limit=16, batch_prompts=8)
  assert stats["total"] == 64 and stats["prompts"] == 16
  assert 0 < stats["kept"] <= stats["total"]
  records, _ = sources.load_records(out)
  assert len(records) == stats["kept"]
  assert len({r["prompt"] for r in records}) == stats["prompts_with_correct"]
  assert manager.score_responses(records, [r["response"] for r in records]).tolist() == [
      1.0] * len(records)
  tokenizer = load_tokenizer("byte")
  examples = sft.sft_examples(records, tokenizer, config.data.prompt_template)
  assert [tokenizer.decode(r) for _, r in examples] == [r["response"] for r in records]


@pytest.mark.parametrize("algorithm", ["dapo", "vapo", "grpo_v32"])
def test_three_steps_of_each_recipe(algorithm, demo_run, tmp_path):
  """Finite losses, no skipped steps, parameters move, the recipe's own metrics are written."""
  sft_ckpt = os.path.join(demo_run[0], "sft", "checkpoints")
  c = small_config(algorithm, init_checkpoint=sft_ckpt, job="rl")
  trainer = Trainer(c, str(tmp_path))
  before = jax.tree.map(np.asarray, trainer.state.params)
  trainer.run()
  rows = read_metrics(str(tmp_path))
  assert len(rows) == 3
  for r in rows:
    assert r["skipped"] == 0.0
    assert all(np.isfinite(v) for v in r.values() if isinstance(v, float)), r
    assert {"reward", "acc/arithmetic", "kept_group_fraction", "response_len_mean",
            "truncation_rate", "time/rollout", "time/reward", "time/update",
            "tokens_per_s"} <= set(r)
    if algorithm != "vapo" or r["step"] > 1:
      assert {"pg_loss", "entropy", "grad_norm", "clipfrac_high", "clipfrac_low",
              "approx_kl"} <= set(r)
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before,
                         trainer.state.params)
  assert any(jax.tree.leaves(changed))
  if algorithm == "vapo":
    assert "pg_loss" not in rows[0] and "pg_loss" in rows[1]  # value pretraining first
    assert all("critic/value_loss" in r and "explained_variance" in r for r in rows)
    assert "nll_positive" in rows[1]
  if algorithm == "grpo_v32":
    assert all("kl" in r and "offpolicy_masked_frac" in r for r in rows)


def _fake_rollout(trainer, outcomes):
  """Stands in for the sampler only: responses are the gold solution (correct) or a wrong
  answer; the trainer's real verifier scores them."""
  tok = trainer.tokenizer
  calls = iter(outcomes)

  def rollout(step, batch_index, entries_idx):
    per_group = next(calls)
    rows, groups, entries = [], [], []
    for g, (i, pattern) in enumerate(zip(entries_idx, per_group)):
      entry = trainer.train_entries[i]
      for ok in pattern:
        text = entry["solution"] if ok else "0 Answer: -999"
        rows.append((trainer.train_prompts[i], tok.encode(text) + [tok.eos_id]))
        groups.append(g)
        entries.append(entry)
    width = max(len(p) + len(r) for p, r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for n, (p, r) in enumerate(rows):
      tokens[n, :len(p) + len(r)] = p + r
      mask[n, len(p):len(p) + len(r)] = 1
    b = len(rows)
    traj = Trajectories(tokens=tokens, prompt_lens=np.array([len(p) for p, _ in rows]),
                        response_mask=mask, logp_old=np.zeros_like(mask),
                        policy_version=np.zeros_like(tokens), group_id=np.array(groups),
                        finished=np.ones(b, bool), truncated=np.zeros(b, bool))
    return traj, entries
  return rollout


def test_dynamic_sampling_drops_uniform_groups_refills_and_truncates(tmp_path):
  c = small_config("dapo", **{"train.samples_per_prompt": 2})
  trainer = Trainer(c, str(tmp_path))
  right, wrong, mixed = (1, 1), (0, 0), (1, 0)
  trainer._rollout = _fake_rollout(trainer, [
      [right, wrong, mixed, mixed],  # keeps 2 of 4
      [mixed, wrong, mixed, mixed],  # room for 2: the third mixed group is surplus
  ])
  traj, rewards, stats = trainer.collect(step=0)
  assert stats["gen_batches"] == 2 and stats["groups_seen"] == 8 and stats["groups_kept"] == 4
  groups = np.asarray(traj.group_id)
  assert len(np.unique(groups)) == 4 and len(groups) == 8
  for g in np.unique(groups):  # every kept group has both outcomes
    assert sorted(rewards["acc"][groups == g]) == [0.0, 1.0]
  assert stats["raw_acc"] == pytest.approx(4 / 8)  # accuracy before filtering, first batch


def test_dynamic_sampling_gives_up_with_a_clear_error(tmp_path):
  c = small_config("dapo", **{"train.samples_per_prompt": 2, "rl.max_num_gen_batches": 2})
  trainer = Trainer(c, str(tmp_path))
  all_wrong = [[(0, 0)] * 4] * 2
  trainer._rollout = _fake_rollout(trainer, all_wrong)
  with pytest.raises(RuntimeError, match="max_num_gen_batches=2"):
    trainer.collect(step=0)


def test_killed_run_resumes_to_the_same_result(demo_run, tmp_path):
  """Three steps straight vs two steps, a 'kill', and a rerun of the same command; with a
  difficulty curriculum whose level rises after the first step, so the resumed run must also
  restore the curriculum (its level and regenerated training set) from the checkpoint."""
  sft_ckpt = os.path.join(demo_run[0], "sft", "checkpoints")
  curriculum = {"data.curriculum": "difficulty", "data.curriculum_window": 1,
                "data.curriculum_threshold": 0.01,
                # The small SFT model solves no level-1 sum: keep all-wrong groups.
                "rl.dynamic_sampling": False}
  straight = Trainer(small_config(init_checkpoint=sft_ckpt, job="rl", **curriculum),
                     str(tmp_path / "a"))
  straight.run()
  first = Trainer(small_config(init_checkpoint=sft_ckpt, job="rl", **{"train.steps": 2},
                               **curriculum), str(tmp_path / "b"))
  first.run()
  resumed = Trainer(small_config(init_checkpoint=sft_ckpt, job="rl", **curriculum),
                    str(tmp_path / "b"))
  assert resumed.start_step == 2
  assert resumed.curriculum.state_dict() == first.curriculum.state_dict()
  assert resumed.train_entries == first.train_entries
  resumed.run()
  assert read_metrics(str(tmp_path / "a"))[0]["curriculum/level"] == 1.0
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, straight.state.params),
               jax.tree.map(np.asarray, resumed.state.params))
  a, b = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
  assert a[-1]["reward"] == b[-1]["reward"] and a[-1]["loss"] == b[-1]["loss"]


SMALL_FLAGS = ("--config.data.difficulty=0", "--config.data.train_size=48",
               "--config.data.heldout_size=64", "--config.rollout.max_new_tokens=16",
               "--config.sft.epochs=60", "--config.sft.batch_size=16",
               "--config.sft.dense_warmup_steps=40", "--config.train.steps=6",
               "--config.train.prompts_per_step=4", "--config.train.samples_per_prompt=4",
               "--config.train.eval_every=0", "--config.train.checkpoint_every=1")


def _launch(workdir):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  return subprocess.Popen([sys.executable, os.path.join(root, "launch", "train.py"),
                           "--config=" + os.path.join(root, "configs", "demo.py"),
                           f"--workdir={workdir}", *SMALL_FLAGS],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.mark.slow
def test_sigkilled_demo_resumes_to_the_same_final_metrics(tmp_path):
  """The README's main command, SIGKILLed mid-RL and rerun, ends where an uninterrupted run
  ends (same final reward, loss and held-out accuracy)."""
  import signal
  import time
  straight = tmp_path / "straight"
  assert _launch(straight).wait(timeout=900) == 0
  killed = tmp_path / "killed"
  proc = _launch(killed)
  deadline = time.time() + 900
  while not (killed / "rl" / "checkpoints" / "3").exists():
    assert proc.poll() is None and time.time() < deadline, "run ended before step 3"
    time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (killed / "results.json").exists()
  assert _launch(killed).wait(timeout=900) == 0
  final = [read_metrics(str(d / "rl"))[-1] for d in (straight, killed)]
  assert final[0]["step"] == final[1]["step"] == 6
  for key in ("reward", "loss", "grad_norm", "acc/arithmetic"):
    assert final[0][key] == final[1][key], key
  results = [json.load(open(d / "results.json")) for d in (straight, killed)]
  assert results[0]["rl_heldout_acc"] == results[1]["rl_heldout_acc"]
