"""The RL loop end to end on the tiny MoE + MLA + DSA demo model with the real addition
verifier: the demo pipeline (SFT cold start, then RL, results table), three steps of each
flagship recipe, on-policy ratios, dynamic sampling, resume after a kill, and the trainer and
SFT on 8-device meshes (data / FSDP / tensor / expert parallel, optimiser state offloaded to
host memory, a planned mesh) against one device."""

import json
import os

import jax
import ml_collections
import numpy as np
import pytest

from configs import demo
from rl.config.validation import validate
from rl.jobs import sft_then_rl
from rl.jobs.trainer import Trainer
from rl.rollout.sources import Rollout
from scripted_rollout import scripted_trajectories


def small_config(algorithm="dapo", **overrides) -> ml_collections.ConfigDict:
  """The demo shrunk to seconds: single-digit sums, 4 prompts x 4 samples per step."""
  c = ml_collections.ConfigDict(demo.get_config(algorithm).to_dict())
  c.data.difficulty = 0
  c.data.train_size = 48
  c.data.heldout_size = 64
  c.rollout.max_new_tokens = 16
  c.sft.epochs = 70
  c.sft.batch_size = 16
  c.sft.dense_steps = 10  # the demo's dense stage, shortened (and its frozen warm-up off)
  c.sft.dense_warmup_steps = 0
  c.sft.log_every = 1000
  c.train.steps = 3
  c.train.prompts_per_step = 4
  c.train.samples_per_prompt = 4
  c.train.eval_every = 0
  c.train.checkpoint_every = 1
  c.rl.critic_warmup_steps = min(c.rl.critic_warmup_steps, 1)
  c.mesh.devices = 1  # one of the 8 test devices (fast); the mesh tests below use all 8
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (c[section] if section else c)[field] = value
  validate(c)
  return c


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
  """The demo pipeline, shortened: SFT, held-out eval, 3 DAPO steps, table and plot."""
  workdir = str(tmp_path_factory.mktemp("demo"))
  results = sft_then_rl.run_sft_then_rl(small_config(), workdir)
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
  # The cold start taught the task: the held-out loss fell by more than half. (Whether any of
  # the 64 held-out sums is already solved greedily after these 210 steps depends on the host's
  # floating point: 0 of 64 on an AVX2-only CPU, some on AVX-512 ones; the learning gates in
  # test_learning.py assert accuracy on a longer SFT.)
  sft_rows = read_metrics(os.path.join(workdir, "sft"))
  assert sft_rows[-1]["sft/eval_loss"] < 0.5 * sft_rows[0]["sft/eval_loss"]
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
  from rl.jobs import select_prompts as select
  from rl.jobs import sft
  from rl.data import sources
  from rl.rewards import manager
  from models.tokenizer import load_tokenizer
  out = str(tmp_path / "rs.jsonl")
  config = small_config()
  stats, outcomes = select.sample_and_select(config, os.path.join(demo_run[0], "sft"),
                                             rule="rejection", n=4, out_path=out, limit=16,
                                             batch_prompts=8)
  assert stats["samples"] == 64 and stats["prompts"] == 16
  assert 0 < stats["written"] <= stats["correct"] == int(outcomes.accuracies.sum())
  flat_records = [r for r in outcomes.records for _ in range(4)]
  flat_responses = [t for samples in outcomes.responses for t in samples]
  assert manager.score_responses(flat_records, flat_responses).tolist() == (
      outcomes.accuracies.ravel().tolist())
  records, _ = sources.load_records(out)
  assert len(records) == stats["written"]
  assert len({r["prompt"] for r in records}) == stats["prompts_with_correct"]
  assert manager.score_responses(records, [r["response"] for r in records]).tolist() == [
      1.0] * len(records)
  tokenizer = load_tokenizer("byte")
  examples = sft.sft_examples(records, tokenizer, config.data.prompt_template)
  assert [tokenizer.decode(r) for _, r in examples] == [r["response"] for r in records]


def test_select_prompts_launcher_writes_the_worst_of_n_prompts_the_trainer_reads(demo_run,
                                                                                 tmp_path):
  """launch/select_prompts.py --rule=worst_of_n on the SFT checkpoint writes the training
  prompts not solved by all 4 samples (those of an in-process pass with the same seed), which
  the trainer loads back as its prompts (config.data.source=files)."""
  import subprocess
  import sys
  from rl.data import entries
  from rl.jobs import select_prompts as select
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
  out = str(tmp_path / "hard.jsonl")
  env = dict(os.environ, JAX_DEFAULT_MATMUL_PRECISION="highest")  # as conftest sets it here
  done = subprocess.run(
      [sys.executable, os.path.join(root, "launch", "select_prompts.py"),
       "--config=" + os.path.join(root, "configs", "demo.py"), *SMALL_FLAGS,
       "--checkpoint=" + os.path.join(demo_run[0], "sft"), "--rule=worst_of_n", "--n=4",
       "--limit=16", "--batch_prompts=8", f"--out={out}"],
      capture_output=True, text=True, env=env, timeout=600, cwd=root)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "worst_of_n: wrote " in done.stdout
  _, outcomes = select.sample_and_select(small_config(), os.path.join(demo_run[0], "sft"),
                                         rule="worst_of_n", n=4, out_path=str(tmp_path / "x"),
                                         limit=16, batch_prompts=8)
  expected = [r for r, acc in zip(outcomes.records, outcomes.accuracies) if acc.min() < 1.0]
  assert 0 < len(expected) < 16  # the checkpoint solves some prompts every time, not all
  heldout = tmp_path / "heldout.jsonl"
  heldout.write_text(json.dumps({"prompt": "What is 1+1?", "answer": "2"}) + "\n")
  config = small_config(**{"data.source": "files", "data.train_files": out,
                           "data.heldout_files": str(heldout), "sft.carry_slip_rate": 0.0})
  train, _ = entries.load_entries(config)
  assert [(e["prompt"], e["answer"]) for e in train] == [
      (r["prompt"], r["answer"]) for r in expected]
  bad = subprocess.run([sys.executable, os.path.join(root, "launch", "select_prompts.py"),
                        "--rule=best_of_n"], capture_output=True, text=True, env=env, timeout=600,
                       cwd=root)
  assert bad.returncode != 0 and "flag --rule=best_of_n: value should be one of" in bad.stderr


@pytest.mark.parametrize("algorithm", ["dapo", "vapo", "grpo_v32"])
def test_three_steps_of_each_recipe(algorithm, demo_run, tmp_path):
  """Finite losses, no skipped steps, parameters move, the recipe's own metrics are written."""
  sft_ckpt = os.path.join(demo_run[0], "sft", "checkpoints")
  # grpo_v32 keeps the sampling mask: its top-p sampler (the demo's) records kept ids, which
  # then go through the batch, the reference log-probs and the update.
  c = small_config(algorithm, init_checkpoint=sft_ckpt, job="rl")
  trainer = Trainer(c, str(tmp_path))
  before = jax.tree.map(np.asarray, trainer.policy.state.params)
  trainer.run()
  rows = read_metrics(str(tmp_path))
  assert len(rows) == 3
  for r in rows:
    assert r["skipped"] == 0.0
    assert all(np.isfinite(v) for v in r.values() if isinstance(v, float)), r
    assert {"reward", "acc/addition", "kept_group_fraction", "response_len_mean",
            "truncation_rate", "time/rollout", "time/reward", "time/update",
            "tokens_per_s"} <= set(r)
    if algorithm != "vapo" or r["step"] > 1:
      assert {"pg_loss", "entropy", "grad_norm", "clipfrac_high", "clipfrac_low",
              "approx_kl"} <= set(r)
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), before,
                         trainer.policy.state.params)
  assert any(jax.tree.leaves(changed))
  if algorithm == "vapo":
    assert "pg_loss" not in rows[0] and "pg_loss" in rows[1]  # value pretraining first
    assert all("critic/value_loss" in r and "explained_variance" in r for r in rows)
    assert "nll_positive" in rows[1]
  if algorithm == "grpo_v32":
    assert all("kl" in r and "offpolicy_masked_frac" in r for r in rows)
    assert all(r["kept_cut_tokens"] >= 0 for r in rows)


@pytest.mark.parametrize("critic_init", ["policy", "random"])
def test_critic_starts_from_the_policys_checkpoint(critic_init, demo_run, tmp_path):
  """config.rl.critic_init="policy" (VAPO's default): the critic holds the SFT checkpoint's
  weights in every parameter but its scalar head, and its MoE router biases, as copies (the
  policy's update donates its buffers); "random": none of the SFT weights."""
  sft_ckpt = os.path.join(demo_run[0], "sft", "checkpoints")
  trainer = Trainer(small_config("vapo", init_checkpoint=sft_ckpt, job="rl",
                                 **{"rl.critic_init": critic_init}), str(tmp_path))
  policy = dict(jax.tree_util.tree_flatten_with_path(trainer.policy.state.params)[0])
  critic = jax.tree_util.tree_flatten_with_path(trainer.critic.state.params)[0]
  same = {jax.tree_util.keystr(k): np.array_equal(np.asarray(v), np.asarray(policy[k]))
          for k, v in critic if k in policy and v.shape == policy[k].shape}
  assert "['head']['kernel'].value" not in same and len(same) == len(critic) - 1
  biases = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trainer.critic.rest),
                                                  jax.tree.leaves(trainer.policy.rest))]
  if critic_init == "policy":
    assert all(same.values()) and all(biases)
    assert all(v.unsafe_buffer_pointer() != policy[k].unsafe_buffer_pointer()
               for k, v in critic if k in policy)
  else:
    assert not any(same.values())


def test_router_biases_move_between_steps_not_within_one(demo_run, tmp_path):
  """With a large aux-loss-free bias rate the MoE router biases move after every RL step, yet
  each step's one update is on-policy (ratio 1, nothing clipped): the rollout and the update of
  a step route with the same bias. Keep-routing is off (dapo), so a bias moved in between
  would change the update's expert choices and show as approx_kl > 0."""
  sft_ckpt = os.path.join(demo_run[0], "sft", "checkpoints")
  trainer = Trainer(small_config(init_checkpoint=sft_ckpt, job="rl",
                                 **{"model.router_bias_rate": 0.5}), str(tmp_path))
  assert not trainer.config.rl.keep_routing
  biases = [np.asarray(jax.tree.leaves(trainer.policy.rest)[0])]
  for step in range(3):
    traj, rewards, _ = trainer.collect(step)
    metrics = trainer.update(step, trainer.build_batch(traj, rewards,
                                                       trainer.advantages(traj, rewards)))
    biases.append(np.asarray(jax.tree.leaves(trainer.policy.rest)[0]))
    assert abs(metrics["approx_kl"]) < 1e-5 and metrics["clipfrac_low"] == 0.0, metrics
    assert metrics["moe/load_max_over_mean/0"] >= 1.0
    assert not np.array_equal(biases[-1], biases[-2])  # moved by +-0.5 per expert


def test_reference_and_sampler_gap_share_one_compiled_forward(tmp_path):
  """With a KL term and FP8 sampler weights, the reference model's log-probs and the sampler
  gap (the trainer's own log-probs before the update) go through one jitted forward, compiled
  once for the step's batch shape (they were two jit wrappers of it, compiled twice)."""
  c = small_config("grpo_v32", **{"rollout.weight_dtype": "fp8_e4m3", "train.steps": 1})
  trainer = Trainer(c, str(tmp_path))
  traj, rewards, _ = trainer.collect(0)
  batch = trainer.build_batch(traj, rewards, trainer.advantages(traj, rewards))
  metrics = trainer.update(0, batch)
  assert "logp_ref" in batch and "sampler/logp_gap_mean" in metrics
  assert trainer.logprobs._cache_size() == 1


def _fake_rollout(trainer, outcomes):
  """Stands in for the sampler only: responses are the gold solution (correct) or a wrong
  answer; the trainer's real verifier scores them."""
  calls = iter(outcomes)

  def rollout(step, batch_index, entries_idx):
    return Rollout(*scripted_trajectories(trainer, [(i, ok, g) for g, (i, pattern)
                                                    in enumerate(zip(entries_idx, next(calls)))
                                                    for ok in pattern]), {})
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
  c = small_config("dapo", **{"train.samples_per_prompt": 2, "rl.max_num_gen_batches": 2,
                              "rl.fill_at_cap": False})
  trainer = Trainer(c, str(tmp_path))
  all_wrong = [[(0, 0)] * 4] * 2
  trainer._rollout = _fake_rollout(trainer, all_wrong)
  with pytest.raises(RuntimeError, match="max_num_gen_batches=2"):
    trainer.collect(step=0)


def test_dynamic_sampling_fills_at_the_cap_when_configured(tmp_path):
  """config.rl.fill_at_cap=True: at max_num_gen_batches the step keeps its varied groups and
  tops the batch up with uniform ones it saw (counted), instead of stopping the run."""
  c = small_config("dapo", **{"train.samples_per_prompt": 2, "rl.max_num_gen_batches": 2,
                              "rl.fill_at_cap": True})
  trainer = Trainer(c, str(tmp_path))
  right, wrong, mixed = (1, 1), (0, 0), (1, 0)
  trainer._rollout = _fake_rollout(trainer, [[right, wrong, mixed, right],
                                             [right, right, wrong, right]])
  traj, rewards, stats = trainer.collect(step=0)
  groups = np.asarray(traj.group_id)
  assert stats["gen_batches"] == 2 and stats["groups_kept"] == 1
  assert stats["filled_groups"] == 3 and len(np.unique(groups)) == 4 and len(groups) == 8
  assert sorted(rewards["acc"][groups == groups[0]]) == [0.0, 1.0]  # the varied group first


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
  assert resumed.leg.start_step == 2
  # The MoE router biases (moved by the aux-loss-free step after each RL step) come back too.
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, resumed.policy.rest),
               jax.tree.map(np.asarray, first.policy.rest))
  assert np.abs(np.asarray(jax.tree.leaves(resumed.policy.rest)[0])).max() > 0
  assert resumed.task.curriculum.state_dict() == first.task.curriculum.state_dict()
  assert resumed.task.train_entries == first.task.train_entries
  resumed.run()
  assert read_metrics(str(tmp_path / "a"))[0]["curriculum/level"] == 1.0
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, (straight.policy.state.params, straight.policy.rest)),
               jax.tree.map(np.asarray, (resumed.policy.state.params, resumed.policy.rest)))
  a, b = read_metrics(str(tmp_path / "a")), read_metrics(str(tmp_path / "b"))
  assert a[-1]["reward"] == b[-1]["reward"] and a[-1]["loss"] == b[-1]["loss"]


SMALL_FLAGS = ("--config.data.difficulty=0", "--config.data.train_size=48",
               "--config.data.heldout_size=64", "--config.rollout.max_new_tokens=16",
               "--config.sft.epochs=70", "--config.sft.batch_size=16",
               "--config.sft.dense_steps=10", "--config.sft.dense_warmup_steps=0",
               "--config.train.steps=6",
               "--config.train.prompts_per_step=4", "--config.train.samples_per_prompt=4",
               "--config.train.eval_every=0", "--config.train.checkpoint_every=1")


def _launch(workdir):
  import subprocess
  import sys
  root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
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
  for key in ("reward", "loss", "grad_norm", "acc/addition"):
    assert final[0][key] == final[1][key], key
  results = [json.load(open(d / "results.json")) for d in (straight, killed)]
  assert results[0]["rl_heldout_acc"] == results[1]["rl_heldout_acc"]


# ---------------------------------------------------------------------------- Meshes

TRAINER_MESHES = {
    "dp2_fsdp2_tp2": {"data": 2, "fsdp": 2, "tensor": 2},
    "ep4_fsdp2": {"data": 1, "expert": 4, "fsdp": 2},
}


def mesh_config(sft_ckpt, shape=None, **overrides):
  """Two DAPO steps from the demo's SFT checkpoint; on 8 devices with mesh `shape`."""
  c = small_config(init_checkpoint=sft_ckpt, job="rl", **{"train.steps": 2, **overrides})
  if shape is not None:
    c.mesh.devices = 8
    c.mesh.shape.update(shape)
  return c


@pytest.fixture(scope="module")
def one_device_run(demo_run, tmp_path_factory):
  """The reference: two DAPO steps on one device."""
  sft_ckpt = os.path.join(demo_run[0], "sft", "checkpoints")
  workdir = str(tmp_path_factory.mktemp("one_device"))
  trainer = Trainer(mesh_config(sft_ckpt), workdir)
  trainer.run()
  return sft_ckpt, jax.tree.map(np.asarray, trainer.policy.state.params), read_metrics(workdir)


def _assert_params_close(got, want, rel=1e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    w = np.asarray(w)
    np.testing.assert_allclose(np.asarray(g), w, rtol=rel, atol=rel * float(np.abs(w).max()))


@pytest.mark.parametrize("name", list(TRAINER_MESHES))
def test_trainer_on_a_mesh_matches_one_device(one_device_run, name, tmp_path,
                                              expert_parallel_choices):
  """Two RL steps (rollout, rewards, dynamic sampling, update) with parameters and optimiser
  state sharded over an 8-device mesh, and expert-parallel MoE dispatch where the mesh has an
  expert axis, give the one-device run's rewards, losses and parameters (fp32, rel <= 1e-5)."""
  from models import sharding as sharding_lib
  sft_ckpt, want_params, want_metrics = one_device_run
  expert_parallel = expert_parallel_choices

  trainer = Trainer(mesh_config(sft_ckpt, TRAINER_MESHES[name]), str(tmp_path))
  assert trainer.placement.size == 8
  trainer.run()
  got = read_metrics(str(tmp_path))
  for g, w in zip(got, want_metrics, strict=True):
    assert g["reward"] == w["reward"] and g["kept_acc"] == w["kept_acc"], (g, w)
    assert g["loss"] == pytest.approx(w["loss"], rel=1e-5, abs=1e-7)
  _assert_params_close(trainer.policy.state.params, want_params)
  # It really ran sharded: parameters split over the mesh, none of the big ones replicated,
  # the optimiser moments laid out like their parameters.
  params = trainer.policy.state.params
  assert sum(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params)) > 5
  sharding_lib.check_not_replicated(params, trainer.placement.param_shardings(params),
                                    min_bytes=64 << 10)
  mu = trainer.policy.state.opt_state[1][0].mu  # clip_by_global_norm, then adamw's scale_by_adam
  assert [x.sharding for x in jax.tree.leaves(mu)] == [
      x.sharding for x in jax.tree.leaves(params)]
  assert expert_parallel and any(expert_parallel) == (TRAINER_MESHES[name].get("expert", 1) > 1)


def test_offloaded_optimizer_state_resumes_on_another_mesh(one_device_run, tmp_path):
  """One step on a data x FSDP mesh with the optimiser state in pinned host memory, then the
  same command resumed from its checkpoint on one device without offload: the second step
  ends where the straight one-device run ends (the checkpoint carries no layout)."""
  from models import remat
  if not remat.host_memory_supported():
    pytest.skip("no pinned host memory here")
  sft_ckpt, want_params, want_metrics = one_device_run
  first = Trainer(mesh_config(sft_ckpt, {"data": 2, "fsdp": 4}, **{"train.steps": 1,
                                                                     "optim.offload_state": True}),
                  str(tmp_path))
  first.run()
  assert {x.sharding.memory_kind for x in jax.tree.leaves(first.policy.state.opt_state)} == {
      remat.HOST_MEMORY}
  assert read_metrics(str(tmp_path))[0]["loss"] == pytest.approx(want_metrics[0]["loss"],
                                                                 rel=1e-5, abs=1e-7)
  resumed = Trainer(mesh_config(sft_ckpt), str(tmp_path))
  assert resumed.leg.start_step == 1 and resumed.placement.size == 1
  resumed.run()
  _assert_params_close(resumed.policy.state.params, want_params)
  assert read_metrics(str(tmp_path))[-1]["reward"] == want_metrics[-1]["reward"]


def test_mesh_auto_builds_the_planned_mesh(tmp_path):
  """config.mesh.auto: the trainer lays the run out on the planner's best mesh for the
  config's devices and device kind."""
  from models import planner
  from rl.parallel import placement
  c = small_config(**{"mesh.auto": True, "mesh.devices": 8, "mesh.device_kind": "h100"})
  best = placement.best_mesh(c, 8, planner.DEVICES["h100"])
  trainer = Trainer(c, str(tmp_path))
  assert trainer.placement.plan == best
  assert dict(trainer.placement.mesh.shape) == best.mesh
  assert trainer.placement.size == 8


def test_micro_batches_that_do_not_split_over_the_mesh_are_reported(tmp_path):
  """4 x 4 sequences in 4 micro-batches are 4 rows each: on an 8-way data mesh they cannot be
  split, so every device would repeat them; the trainer says so (and not for 16 rows)."""
  from rl.parallel import placement
  c = small_config(**{"mesh.devices": 8, "train.micro_batches": 4})
  mesh = placement.Placement.from_config(c)
  assert mesh.warn_unsplit_rows(4, "a micro-batch")
  assert not mesh.warn_unsplit_rows(16, "a micro-batch")


def test_mesh_needing_more_devices_than_there_are_is_refused(tmp_path):
  with pytest.raises(ValueError, match="config.mesh.devices=16"):
    Trainer(small_config(**{"mesh.devices": 16}), str(tmp_path))


def test_sft_on_a_mesh_matches_one_device(tmp_path):
  """Two SFT epochs (packed rows, the DSA dense stage, warm-up and sparse stage) with parameters
  and AdamW state sharded over data x FSDP x tensor give the one-device losses (fp32,
  rel <= 1e-5)."""
  from rl.jobs import sft
  overrides = {"sft.epochs": 2, "sft.dense_steps": 1, "sft.dense_warmup_steps": 1,
               "sft.pack": True}
  one = sft.run(small_config(**overrides), str(tmp_path / "one"))
  c = small_config(**overrides)
  c.mesh.devices = 8
  c.mesh.shape.update(data=2, fsdp=2, tensor=2)
  mesh = sft.run(c, str(tmp_path / "mesh"))
  for key in ("sft/eval_loss_start", "sft/eval_loss", "sft/train_loss"):
    assert mesh[key] == pytest.approx(one[key], rel=1e-5), key


def test_streaming_rollouts_carry_groups_over_to_later_steps(one_device_run, tmp_path):
  """config.rollout.streaming: the pool starts with twice the step's groups, so each later
  step's batch mixes groups started under the current weights with groups left over from the
  step before (alpha = 0.5); no token is older than max_staleness = 1 version, and the first
  step, sampled entirely by the current policy, is on-policy (ratio 1)."""
  sft_ckpt = one_device_run[0]
  c = mesh_config(sft_ckpt, **{"train.steps": 3, "rollout.streaming.enabled": True,
                               "rollout.streaming.round_tokens": 4,
                               "rl.dynamic_sampling": False, "sft.carry_slip_rate": 0.0})
  Trainer(c, str(tmp_path)).run()
  rows = read_metrics(str(tmp_path))
  assert rows[0]["stream/old_groups"] == 0 and abs(rows[0]["approx_kl"]) < 1e-5
  assert all(r["stream/fresh_groups"] + r["stream/old_groups"] == 4 for r in rows)
  assert any(r["stream/old_groups"] > 0 for r in rows[1:])
  assert all(r["stream/token_staleness_max"] <= 1 for r in rows)
  assert all(np.isfinite(r["loss"]) and r["skipped"] == 0 for r in rows)


def test_config_kernel_backend_reaches_every_forward(tmp_path, monkeypatch):
  """config.kernel_backend is the backend the DSA kernels are asked for in SFT, the held-out
  evals, the rollout and the RL update (every forward once asked for "auto", whatever the
  config said)."""
  import kernels
  asked = []
  resolve = kernels._resolve
  monkeypatch.setattr(kernels, "_resolve",
                      lambda backend, *rest: asked.append(backend) or resolve(backend, *rest))
  c = small_config(kernel_backend="reference", **{"sft.epochs": 1, "train.steps": 1})
  sft_then_rl.run_sft_then_rl(c, str(tmp_path))
  assert asked and set(asked) == {"reference"}, sorted(set(asked))


def test_optimiser_fields_reach_every_optimiser(tmp_path, monkeypatch):
  """config.optim's clip, betas and weight decay build the policy's and the critic's AdamW
  (the critic once fell back to optax's betas), config.sft's clip and weight decay SFT's (once
  a hard-coded clip of 1.0)."""
  from rl.jobs import sft
  from rl.core import train_step as ts
  built = []
  make_optimizer = ts.make_optimizer
  fields = ("grad_clip", "b1", "b2", "weight_decay")

  def spy(**kw):
    built.append({k: kw[k] for k in fields if k in kw})
    return make_optimizer(**kw)
  monkeypatch.setattr(ts, "make_optimizer", spy)
  optim = {"optim.grad_clip": 0.25, "optim.b1": 0.8, "optim.b2": 0.95,
           "optim.weight_decay": 0.03}
  Trainer(small_config("vapo", **optim), str(tmp_path / "rl"))
  want = dict(grad_clip=0.25, b1=0.8, b2=0.95, weight_decay=0.03)
  assert built == [want, want]  # policy, critic
  built.clear()
  sft.run(small_config(**{"sft.epochs": 1, "sft.grad_clip": 0.5, "sft.weight_decay": 0.02,
                          "sft.dense_warmup_steps": 1}), str(tmp_path / "sft"))
  assert built == [dict(grad_clip=0.5, weight_decay=0.02)]


def test_accuracy_is_named_by_the_domains_of_the_data(tmp_path):
  """A run reading prompt files (config.data.task at its default "arithmetic", unread) logs its
  accuracy per domain of its records: math records under acc/math, addition puzzles under
  acc/addition, each the mean over that domain's rows only (the scripted sampler solves the
  math prompts and fails the puzzles), beside the overall acc; no acc/arithmetic."""
  from rl.rewards import puzzles
  math = [{"prompt": f"What is {a}+{a}?", "answer": str(2 * a), "solution": f"\\boxed{{{2 * a}}}"}
          for a in (3, 4)]
  records = math + puzzles.make("addition", size=2, seed=0, difficulty=0)
  (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  (tmp_path / "heldout.jsonl").write_text(json.dumps({"prompt": "What is 1+1?",
                                                      "answer": "2"}) + "\n")
  c = small_config("grpo", **{"data.source": "files", "data.task": "arithmetic",
                              "data.train_files": str(tmp_path / "train.jsonl"),
                              "data.heldout_files": str(tmp_path / "heldout.jsonl"),
                              "train.steps": 1, "train.samples_per_prompt": 2,
                              "rl.dynamic_sampling": False, "sft.carry_slip_rate": 0.0})
  trainer = Trainer(c, str(tmp_path / "run"))

  def rollout(step, batch_index, entries_idx):
    picks = [(i, "task" not in trainer.task.train_entries[i], g)
             for g, i in enumerate(entries_idx) for _ in range(2)]
    return Rollout(*scripted_trajectories(trainer, picks), {})
  trainer._rollout = rollout
  trainer.run()
  [row] = read_metrics(str(tmp_path / "run"))
  assert row["acc/math"] == 1.0 and row["acc/addition"] == 0.0 and row["acc"] == 0.5, row
  assert not [k for k in row if k.startswith("acc/") and k not in ("acc/math", "acc/addition")]


def test_step_metrics_combine_the_updates_of_a_step():
  """A step's metrics over its updates: means, but max of *_max, min of *_min, the count of
  skipped updates and the summed expert load."""
  from rl.jobs.trainer import _step_metrics
  out, load = _step_metrics([
      {"pg_loss": 1.0, "ratio_max": 1.5, "ratio_min": 0.9, "skipped": 0.0,
       "router_load": np.array([[1.0, 3.0]])},
      {"pg_loss": 3.0, "ratio_max": 1.2, "ratio_min": 0.7, "skipped": 1.0,
       "router_load": np.array([[2.0, 2.0]])}])
  assert out == {"pg_loss": 2.0, "ratio_max": 1.5, "ratio_min": 0.7, "skipped": 1.0}
  np.testing.assert_array_equal(load, [[3.0, 5.0]])
