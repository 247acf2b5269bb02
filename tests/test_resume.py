"""Runs that survive preemption and restarts (rl/checkpoint.py, the RL trainer, SFT and the
SFT-then-RL pipeline): SIGTERM saves at the next step boundary and the rerun ends where an
uninterrupted run ends; a corrupt latest checkpoint falls back to the step before; resumed runs
do not log re-run steps twice and add up their wall time; the workdir's config.json refuses a
resume with another model shape; a gs:// workdir reaches orbax and etils.epath untouched (a
local fake of GCS, no network)."""

import json
import os
import signal
import time

import jax
import ml_collections
import numpy as np
import pytest

from configs import common
from rl import checkpoint
from rl.trainer import Trainer


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  """A 2-layer dense model on single-digit sums, 2 prompts x 2 samples, 8 new tokens, one
  device; checkpoints only at the end (or when preempted)."""
  c = common.base_config(preset="tiny_dense", algorithm="grpo")
  c.data.update(difficulty=0, train_size=16, heldout_size=8)
  c.rollout.max_new_tokens = 8
  c.rl.dynamic_sampling = False
  c.sft.update(epochs=2, batch_size=4, log_every=1000, checkpoint_every=100)
  c.train.update(steps=3, prompts_per_step=2, samples_per_prompt=2, eval_every=0,
                 checkpoint_every=100)
  c.mesh.devices = 1
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (c[section] if section else c)[field] = value
  common.validate(c)
  return c.lock()


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def params_of(trainer):
  return jax.tree.map(np.asarray, (trainer.state.params, trainer.rest))


def signal_during_step(trainer, at_step, signum=signal.SIGTERM):
  """Sends `signum` to this process while the trainer updates step `at_step` (0-based): a
  signal that arrives in the middle of a step, as a preemption notice does."""
  update = trainer.update

  def update_and_signal(step, batch):
    if step == at_step:
      os.kill(os.getpid(), signum)
    return update(step, batch)
  trainer.update = update_and_signal


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
  """Three steps without interruption: final parameters and metrics rows."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  trainer = Trainer(tiny_config(), workdir)
  trainer.run()
  return params_of(trainer), read_metrics(workdir)


def test_sigterm_mid_step_saves_that_step_and_the_rerun_matches(straight_run, tmp_path):
  """A SIGTERM during step 2 of 3 lets step 2 finish, saves a checkpoint of it
  (checkpoint_every=100: no other save would happen) and raises Preempted; the rerun starts at
  step 2, logs each step once, and ends with the uninterrupted run's parameters and metrics.
  The handler is put back afterwards."""
  signum = signal.SIGTERM
  want_params, want_rows = straight_run
  workdir = str(tmp_path)
  before = signal.getsignal(signum)
  first = Trainer(tiny_config(), workdir)
  signal_during_step(first, at_step=1, signum=signum)
  with pytest.raises(checkpoint.Preempted, match=r"after step 2/3"):
    first.run()
  assert signal.getsignal(signum) is before
  assert checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")).latest_step() == 2
  assert [r["step"] for r in read_metrics(workdir)] == [1, 2]

  resumed = Trainer(tiny_config(), workdir)
  assert resumed.start_step == 2
  resumed.run()
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  for got, want in zip(rows, want_rows, strict=True):
    assert got["reward"] == want["reward"] and got["loss"] == want["loss"], (got, want)
  jax.tree.map(np.testing.assert_array_equal, params_of(resumed), want_params)


def test_guard_catches_one_signal_and_lets_the_second_through():
  """Inside PreemptionGuard a SIGINT only sets the flag (no KeyboardInterrupt); the previous
  handler is back at once, so a second Ctrl-C interrupts as usual."""
  with checkpoint.PreemptionGuard() as guard:
    assert not guard.requested()
    os.kill(os.getpid(), signal.SIGINT)
    assert guard.requested() and guard.received == "SIGINT"
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)


def preempt_at_boundary(monkeypatch, boundary):
  """SIGTERM to this process just before the loop's `boundary`-th (1-based) step-boundary
  check: the real handler sets the flag that the check then reads."""
  calls = []
  requested = checkpoint.PreemptionGuard.requested

  def signal_then_check(guard):
    calls.append(1)
    if len(calls) == boundary:
      os.kill(os.getpid(), signal.SIGTERM)
    return requested(guard)
  monkeypatch.setattr(checkpoint.PreemptionGuard, "requested", signal_then_check)


def saved_params(directory):
  """{"params", "rest"} of the latest checkpoint in `directory`, as numpy."""
  import orbax.checkpoint as ocp
  ckpt = checkpoint.Checkpointer(directory)
  step = ckpt.latest_step()
  state = ckpt.manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore()))["state"]
  ckpt.close()
  return step, jax.tree.map(np.asarray, {"params": state["params"], "rest": state["rest"]})


def test_sft_preempted_resumes_to_the_uninterrupted_parameters(tmp_path, monkeypatch):
  """SFT (8 steps, checkpoint_every=100) stopped by SIGTERM after step 3 saves step 3 (no
  final metrics in its record: not done) and raises Preempted; the rerun restores parameters,
  AdamW state and step, skips the data it already saw, and its final checkpoint (step 8) holds
  the uninterrupted run's parameters; its wall time adds both legs."""
  from rl import sft
  straight = sft.run(tiny_config(), str(tmp_path / "straight"))
  preempt_at_boundary(monkeypatch, 3)
  with pytest.raises(checkpoint.Preempted, match=r"after step 3/8"):
    sft.run(tiny_config(), str(tmp_path / "resumed"))
  monkeypatch.undo()
  ckpt = checkpoint.Checkpointer(str(tmp_path / "resumed" / "checkpoints"))
  assert ckpt.latest_step() == 3
  first_leg = ckpt.record(3)
  assert "sft/eval_loss" not in first_leg
  ckpt.close()
  resumed = sft.run(tiny_config(), str(tmp_path / "resumed"))
  want_step, want = saved_params(str(tmp_path / "straight" / "checkpoints"))
  got_step, got = saved_params(str(tmp_path / "resumed" / "checkpoints"))
  assert want_step == got_step == 8
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert resumed["sft/eval_loss"] == straight["sft/eval_loss"]
  assert resumed["sft/wall_s"] > first_leg["sft/wall_s"] > 0


def test_pipeline_resumes_a_preempted_sft_stage(tmp_path, monkeypatch):
  """The SFT-then-RL pipeline stopped during SFT: Preempted comes out, nothing of RL or the
  results exists, and the SFT checkpoint is not taken for a finished stage; the rerun
  finishes SFT (final checkpoint at step 8), runs RL from it, and results.json's wall_s counts
  the first leg too."""
  from rl import pipeline
  config = tiny_config(job="sft_rl", **{"train.steps": 1})
  preempt_at_boundary(monkeypatch, 2)
  with pytest.raises(checkpoint.Preempted):
    pipeline.run_sft_then_rl(config, str(tmp_path))
  monkeypatch.undo()
  assert not (tmp_path / "rl").exists() and not (tmp_path / "results.json").exists()
  ckpt = checkpoint.Checkpointer(str(tmp_path / "sft" / "checkpoints"))
  first_leg_s = ckpt.record(ckpt.latest_step())["sft/wall_s"]
  assert ckpt.latest_step() == 2
  ckpt.close()
  t0 = time.perf_counter()
  results = pipeline.run_sft_then_rl(config, str(tmp_path))
  second_leg_s = time.perf_counter() - t0
  assert saved_params(str(tmp_path / "sft" / "checkpoints"))[0] == 8
  assert [r["step"] for r in read_metrics(str(tmp_path / "rl"))] == [1]
  assert json.loads((tmp_path / "results.json").read_text()) == results
  # More than the second leg alone (the first one, model build and compile included, lasted
  # seconds), at most both legs.
  assert second_leg_s < results["wall_s"] <= first_leg_s + second_leg_s
