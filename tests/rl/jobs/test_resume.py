"""Runs that survive preemption and restarts (rl/jobs/checkpoint.py, the RL trainer, SFT and the
SFT-then-RL pipeline): SIGTERM saves at the next step boundary and the rerun ends where an
uninterrupted run ends; a corrupt latest checkpoint falls back to the step before; resumed runs
do not log re-run steps twice and add up their wall time; the workdir's config.json refuses a
resume with another model shape, or another config unless allowed (the change then kept); a
gs:// workdir reaches orbax and etils.epath untouched (a local fake of GCS, no network)."""

import contextlib
import itertools
import json
import os
import signal
import time
import types

import jax
import ml_collections
import numpy as np
import pytest

from rl.core.checks import InputError
from rl.config.defaults import base_config
from rl.config.validation import validate
from rl.jobs import checkpoint
from rl.jobs.trainer import Trainer
from tests.launch.test_launch import launcher_env


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  """A 2-layer dense model on single-digit sums, 2 prompts x 2 samples, 8 new tokens, one
  device; checkpoints only at the end (or when preempted)."""
  c = base_config(preset="tiny_dense", algorithm="grpo")
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
  validate(c)
  return c.lock()


def read_metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def params_of(trainer):
  return jax.tree.map(np.asarray, (trainer.policy.state.params, trainer.policy.rest))


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
  """Three steps without interruption: final parameters, metrics rows and the workdir (which
  holds the step-3 checkpoint and config.json)."""
  workdir = str(tmp_path_factory.mktemp("straight"))
  trainer = Trainer(tiny_config(), workdir)
  trainer.run()
  return params_of(trainer), read_metrics(workdir), workdir


def test_sigterm_mid_step_saves_that_step_and_the_rerun_matches(straight_run, tmp_path):
  """A SIGTERM during step 2 of 3 lets step 2 finish, saves a checkpoint of it
  (checkpoint_every=100: only the signal saves step 2) and raises Preempted; the rerun starts at
  step 2, logs each step once, and ends with the uninterrupted run's parameters and metrics.
  The handler is put back afterwards."""
  signum = signal.SIGTERM
  want_params, want_rows, _ = straight_run
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
  assert resumed.leg.start_step == 2
  resumed.run()
  rows = read_metrics(workdir)
  assert [r["step"] for r in rows] == [1, 2, 3]
  for got, want in zip(rows, want_rows, strict=True):
    assert got["reward"] == want["reward"] and got["loss"] == want["loss"], (got, want)
  jax.tree.map(np.testing.assert_array_equal, params_of(resumed), want_params)


def test_guard_catches_one_signal_and_lets_the_second_through():
  """Inside PreemptionGuard a SIGINT only sets the flag (no KeyboardInterrupt); the previous
  handler is back at once, so a second Ctrl-C interrupts as usual. (The default handler is set
  first: an asyncio runner an earlier test left behind would otherwise be the previous one.)"""
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with checkpoint.PreemptionGuard() as guard:
      assert not guard.requested()
      os.kill(os.getpid(), signal.SIGINT)
      assert guard.requested() and guard.received == "SIGINT"
      with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
  finally:
    signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def preempt_at_boundary(boundary):
  """While entered: SIGTERM to this process just before the loop's `boundary`-th (1-based)
  step-boundary check; the real handler sets the flag that the check then reads."""
  calls = []
  requested = checkpoint.PreemptionGuard.requested

  def signal_then_check(guard):
    calls.append(1)
    if len(calls) == boundary:
      os.kill(os.getpid(), signal.SIGTERM)
    return requested(guard)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(checkpoint.PreemptionGuard, "requested", signal_then_check)
    yield


def saved_params(directory):
  """{"params", "rest"} of the latest checkpoint in `directory`, as numpy."""
  import orbax.checkpoint as ocp
  ckpt = checkpoint.Checkpointer(directory)
  step = ckpt.latest_step()
  state = ckpt.manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore()))["state"]
  ckpt.close()
  return step, jax.tree.map(np.asarray, {"params": state["params"], "rest": state["rest"]})


def test_sft_preempted_resumes_to_the_uninterrupted_parameters_and_metrics(tmp_path, caplog):
  """SFT (8 steps, checkpoint_every=100, log_every=2) stopped by SIGTERM after step 3 saves
  step 3 (no final metrics in its record: not done) and raises Preempted; the rerun restores
  parameters, AdamW state and step, skips the data it already saw, and its final checkpoint
  (step 8) holds the uninterrupted run's parameters; its wall time adds both legs. Both runs
  write metrics.jsonl and TensorBoard like RL: held-out loss at steps 0 and 8, training loss
  every 2 steps; the resumed run's rows equal the uninterrupted run's, none twice. Its start
  line says it resumed and labels the held-out loss it shows as step 0's."""
  from rl.jobs import sft
  config = tiny_config(**{"sft.log_every": 2})
  straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
  straight = sft.run(config, str(straight_dir))
  with preempt_at_boundary(3), pytest.raises(checkpoint.Preempted, match=r"after step 3/8"):
    sft.run(config, str(resumed_dir))
  ckpt = checkpoint.Checkpointer(str(resumed_dir / "checkpoints"))
  assert ckpt.latest_step() == 3
  first_leg = ckpt.record(3)
  assert "sft/eval_loss" not in first_leg
  ckpt.close()
  assert [r["step"] for r in read_metrics(resumed_dir)] == [0, 2]
  with caplog.at_level("INFO", logger="absl"):
    resumed = sft.run(config, str(resumed_dir))
  want_step, want = saved_params(str(straight_dir / "checkpoints"))
  got_step, got = saved_params(str(resumed_dir / "checkpoints"))
  assert want_step == got_step == 8
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert resumed["sft/eval_loss"] == straight["sft/eval_loss"]
  assert resumed["sft/wall_s"] > first_leg["sft/wall_s"] > 0

  rows = read_metrics(resumed_dir)
  assert rows == read_metrics(straight_dir)
  assert [r["step"] for r in rows] == [0, 2, 4, 6, 8]
  assert rows[0] == {"step": 0, "sft/eval_loss": straight["sft/eval_loss_start"]}
  assert rows[-1]["sft/eval_loss"] == straight["sft/eval_loss"]
  assert rows[-1]["sft/train_loss"] == straight["sft/train_loss"]
  assert all(np.isfinite(r["sft/train_loss"]) for r in rows[1:])
  scalars = tensorboard_scalars(straight_dir)
  assert scalars["sft/train_loss"] == [2, 4, 6, 8] and scalars["sft/eval_loss"] == [0, 8]
  assert 4 in tensorboard_restarts(resumed_dir)

  start = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("SFT: "))
  assert "resumed at step 3" in start
  assert f"eval loss {straight['sft/eval_loss_start']:.4f} at step 0" in start


def tensorboard_events(workdir):
  """The events of every file in workdir/tb, in file order."""
  import glob
  import struct

  from tensorboardX.proto import event_pb2
  events = []
  for path in sorted(glob.glob(os.path.join(workdir, "tb", "events.*"))):
    data = open(path, "rb").read()
    at = 0
    while at < len(data):
      (length,) = struct.unpack("Q", data[at:at + 8])
      events.append(event_pb2.Event.FromString(data[at + 12:at + 12 + length]))
      at += 12 + length + 4
  return events


def tensorboard_restarts(workdir):
  """Steps of the SessionLog START events in workdir/tb: TensorBoard hides every earlier event
  at or after such a step (a restarted run's purge)."""
  from tensorboardX.proto import event_pb2
  return [e.step for e in tensorboard_events(workdir) if e.HasField("session_log")
          and e.session_log.status == event_pb2.SessionLog.START]


def tensorboard_scalars(workdir):
  """{tag: [steps]} of the scalars in workdir/tb."""
  scalars = {}
  for event in tensorboard_events(workdir):
    for value in event.summary.value:
      scalars.setdefault(value.tag, []).append(event.step)
  return scalars


def test_corrupt_latest_checkpoint_falls_back_and_rows_are_not_doubled(straight_run, tmp_path,
                                                                       caplog):
  """Three steps checkpointed every step (keep 2), then the step-3 checkpoint's array files
  truncated: the rerun says so in the log, resumes from step 2, drops step 3's metrics row
  before running it again (one row per step, and a TensorBoard purge from step 3), saves a good
  step 3 over the bad one and ends with the uninterrupted run's parameters."""
  import glob
  want_params, want_rows, _ = straight_run
  workdir = str(tmp_path)
  Trainer(tiny_config(**{"train.checkpoint_every": 1}), workdir).run()
  data_files = glob.glob(os.path.join(workdir, "checkpoints", "3", "state", "**", "d", "*"),
                         recursive=True)
  assert data_files
  for path in data_files:
    os.truncate(path, 10)
  with caplog.at_level("WARNING"):
    resumed = Trainer(tiny_config(**{"train.checkpoint_every": 1}), workdir)
  assert resumed.leg.start_step == 2
  assert "checkpoint step 3" in caplog.text and "cannot be restored" in caplog.text
  assert [r["step"] for r in read_metrics(workdir)] == [1, 2]
  resumed.run()
  assert [r["step"] for r in read_metrics(workdir)] == [1, 2, 3]
  assert read_metrics(workdir)[-1]["loss"] == want_rows[-1]["loss"]
  assert 3 in tensorboard_restarts(workdir)
  jax.tree.map(np.testing.assert_array_equal, params_of(resumed), want_params)
  ckpt = checkpoint.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert ckpt.latest_step() == 3
  saved, _ = ckpt.restore(3, resumed._checkpoint_state())  # the bad step was saved over
  ckpt.close()
  jax.tree.map(np.testing.assert_array_equal,
               jax.tree.map(np.asarray, (saved["policy"].params, saved["rest"])), want_params)


def test_resume_with_another_model_shape_is_refused_naming_the_fields(straight_run, caplog):
  """The workdir's config.json is the resolved config; resuming it with another d_model and
  layer count fails before anything is built, naming both fields with both values, even with
  allow_config_change; a change that keeps every parameter shape (rope_theta) is allowed with
  it and logged."""
  _, _, workdir = straight_run
  saved = json.loads(open(os.path.join(workdir, "config.json")).read())
  assert saved["model"]["d_model"] == 64 and saved["train"]["steps"] == 3
  with pytest.raises(InputError,
                     match=r"config.model.d_model=64 there, 128 now; config.model.n_layers=2 "
                           r"there, 3 now"):
    Trainer(tiny_config(**{"model.d_model": 128, "model.n_layers": 3}), workdir,
            allow_config_change=True)
  other = os.path.join(os.path.dirname(workdir), "copy")
  os.makedirs(other)
  with open(os.path.join(other, "config.json"), "w") as f:
    json.dump(saved, f)
  with caplog.at_level("WARNING"):
    checkpoint.save_run_config(other, tiny_config(**{"model.rope_theta": 500.0}), step=3,
                               allow_change=True)
  assert "config.model.rope_theta=10000.0 there, 500.0 now" in caplog.text


def test_resume_under_another_config_is_refused_unless_allowed_and_kept(tmp_path, caplog):
  """A resume (a checkpoint step exists) whose config differs from the one the workdir last ran
  with: another learning rate is refused with one line naming the field, both values and the
  flag that allows it; a longer run (train.steps) is not; an allowed change is appended to
  config_history.jsonl with its step, config.json stays the first run's, and the next resume
  is compared with the newest config."""
  workdir = str(tmp_path)
  first = tiny_config()
  checkpoint.save_run_config(workdir, first, step=None)
  config_json = (tmp_path / "config.json").read_text()
  history = tmp_path / "config_history.jsonl"
  checkpoint.save_run_config(workdir, first, step=3)
  assert not history.exists()
  faster = tiny_config(**{"optim.lr": 3e-4})
  with pytest.raises(InputError) as refused:
    checkpoint.save_run_config(workdir, faster, step=3)
  message = str(refused.value)
  assert "\n" not in message and "config.optim.lr=0.0001 there, 0.0003 now" in message
  assert "--allow_config_change" in message and "train.steps" not in message
  longer = tiny_config(**{"train.steps": 6})
  with caplog.at_level("WARNING"):
    checkpoint.save_run_config(workdir, longer, step=3)
  assert "config.train.steps=3 there, 6 now" in caplog.text
  checkpoint.save_run_config(workdir, tiny_config(**{"train.steps": 6, "optim.lr": 3e-4}),
                             step=5, allow_change=True)
  rows = [json.loads(line) for line in history.read_text().splitlines()]
  assert [r["step"] for r in rows] == [3, 5]
  assert rows[0]["changed"] == {"train.steps": [3, 6]}
  assert rows[1]["changed"] == {"optim.lr": [1e-4, 3e-4]}
  assert rows[1]["config"]["optim"]["lr"] == 3e-4
  assert (tmp_path / "config.json").read_text() == config_json
  checkpoint.save_run_config(workdir, tiny_config(**{"train.steps": 6, "optim.lr": 3e-4}),
                             step=6)
  with pytest.raises(InputError, match=r"config.optim.lr=0.0003 there, 0.0001 now"):
    checkpoint.save_run_config(workdir, longer, step=6)
  assert len(history.read_text().splitlines()) == 2


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
  """gs:// served from a local directory, with no network: etils.epath's gs backend (orbax's
  and ours) maps gs://bucket/x to <root>/bucket/x, tensorstore (orbax's array writer) gets a
  file kvstore at the same place, and the bucket reports no hierarchical namespace. Orbax keeps
  its GCS behaviour otherwise (a commit file instead of a rename). Returns the root."""
  from etils.epath import backend as backend_lib
  from etils.epath import gpath
  from orbax.checkpoint._src.path import gcs_utils
  root = tmp_path / "gcs"
  root.mkdir()

  def local(path):
    text = os.fspath(path)
    return str(root / text[len("gs://"):]) if text.startswith("gs://") else path

  def remote(path):
    text = os.fspath(path)
    return "gs://" + os.path.relpath(text, root) if text.startswith(str(root)) else path

  # epath's own test hook (testing.mock_epath) subclasses this backend too.
  class LocalGcs(backend_lib._OsPathBackend):  # noqa: SLF001
    def open(self, path, mode):
      return super().open(local(path), mode)

    def exists(self, path):
      return super().exists(local(path))

    def isdir(self, path):
      return super().isdir(local(path))

    def listdir(self, path):
      return super().listdir(local(path))

    def glob(self, path):
      return [remote(p) for p in super().glob(local(path))]

    def walk(self, top, **kwargs):
      for directory, dirs, files in super().walk(local(top), **kwargs):
        yield remote(directory), dirs, files

    def makedirs(self, path, **kwargs):
      return super().makedirs(local(path), **kwargs)

    def mkdir(self, path, **kwargs):
      return super().mkdir(local(path), **kwargs)

    def rmtree(self, path):
      return super().rmtree(local(path))

    def remove(self, path):
      return super().remove(local(path))

    def rename(self, path, dst):
      return super().rename(local(path), local(dst))

    def replace(self, path, dst):
      return super().replace(local(path), local(dst))

    def copy(self, path, dst, *, overwrite):
      return super().copy(local(path), local(dst), overwrite=overwrite)

    def stat(self, path):
      return super().stat(local(path))

  monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", LocalGcs())  # noqa: SLF001
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs",
                      lambda path: {"driver": "file", "path": local(path)})
  monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
  monkeypatch.setattr(checkpoint, "_importable", lambda module: True)  # gcsfs, google-cloud
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  return root


def test_preempted_pipeline_on_a_gs_workdir_resumes_from_there(fake_gcs):
  """The SFT-then-RL pipeline with --workdir=gs://bucket/run, stopped by SIGTERM during SFT:
  Preempted comes out, nothing of RL or the results exists, and the SFT checkpoint is not
  taken for a finished stage. The rerun finishes SFT (final checkpoint at step 8), runs RL
  from it, and results.json's wall_s counts the first leg too. Every file of the run (both
  stages' orbax checkpoints, committed GCS-style; config.json; metrics.jsonl; TensorBoard
  events; the held-out record; results.json; the learning curve) is under that path and
  nothing under the working directory (no ./gs:/bucket/run); a third run finds it all there
  (SFT done, RL done: the same results)."""
  from rl.jobs import sft, sft_then_rl
  config = tiny_config(job="sft_rl", **{"train.steps": 1})
  run = fake_gcs / "bucket" / "run"
  # The first leg's clock jumps 1,000 s after its start, so its recorded wall time dwarfs any
  # real second leg: results.json counts it or visibly does not, however loaded the host.
  calls = itertools.count()
  jumping = types.SimpleNamespace(
      perf_counter=lambda: time.perf_counter() + (1000.0 if next(calls) else 0.0))
  with (preempt_at_boundary(2), pytest.raises(checkpoint.Preempted),
        pytest.MonkeyPatch.context() as patch):
    patch.setattr(sft, "time", jumping)
    sft_then_rl.run_sft_then_rl(config, "gs://bucket/run")
  assert not (run / "rl").exists() and not (run / "results.json").exists()
  ckpt = checkpoint.Checkpointer("gs://bucket/run/sft/checkpoints")
  assert ckpt.latest_step() == 2
  first_leg_s = ckpt.record(2)["sft/wall_s"]
  ckpt.close()

  t0 = time.perf_counter()
  results = sft_then_rl.run_sft_then_rl(config, "gs://bucket/run")
  second_leg_s = time.perf_counter() - t0
  # The first leg's time and at most this leg's on top.
  assert first_leg_s >= 1000.0
  assert first_leg_s < results["wall_s"] <= first_leg_s + second_leg_s
  for name in ("sft/checkpoints/8/commit_success.txt", "rl/checkpoints/1/commit_success.txt",
               "sft/config.json", "rl/config.json", "rl/metrics.jsonl", "sft/heldout.json",
               "results.json", "learning_curve.png"):
    assert (run / name).is_file(), name
  assert json.loads((run / "results.json").read_text()) == results
  assert [r["step"] for r in read_metrics(str(run / "rl"))] == [1]
  assert tensorboard_restarts(str(run / "rl")) == [1]
  assert not os.listdir(".")
  again = sft_then_rl.run_sft_then_rl(config, "gs://bucket/run")
  assert again["rl_heldout_acc"] == results["rl_heldout_acc"]
  assert [r["step"] for r in read_metrics(str(run / "rl"))] == [1]


# ------------------------------------------------------------------ launch/train.py + SIGTERM

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def launch(config, workdir, log_path):
  """launch/train.py on `config` (written to a config file beside the workdir), one device,
  its log (stderr) in `log_path`."""
  import subprocess
  import sys
  config_file = os.path.join(os.path.dirname(workdir), "tiny_config.py")
  with open(config_file, "w") as f:
    f.write(f"import ml_collections\n\ndef get_config():\n"
            f"  return ml_collections.ConfigDict({config.to_dict()!r}).lock()\n")
  env = launcher_env()
  return subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "train.py"),
                           f"--config={config_file}", f"--workdir={workdir}"],
                          stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), env=env)


def sigterm_when(proc, ready, timeout=600):
  """SIGTERM to `proc` as soon as `ready()` holds (polled; no fixed sleep decides the step)."""
  deadline = time.time() + timeout
  while not ready():
    assert proc.poll() is None, "the run ended before the signal"
    assert time.time() < deadline, "timed out waiting for the run"
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  return proc.wait(timeout=timeout)


@pytest.mark.slow
def test_sigterm_to_the_rl_launcher_saves_exits_0_and_the_rerun_matches(tmp_path):
  """launch/train.py (RL, 4 steps, checkpoint_every=100: orbax saves only the first step by
  itself) gets SIGTERM once step 1's metrics row is written: it exits 0, its latest checkpoint
  is the step it reached (the last row's), the log says why; the same command then continues
  from the next step, writes each step once and ends with the uninterrupted run's final
  metrics."""
  config = tiny_config(**{"train.steps": 4})
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  assert launch(config, straight, tmp_path / "straight.log").wait(timeout=600) == 0
  metrics = os.path.join(killed, "metrics.jsonl")
  proc = launch(config, killed, tmp_path / "first.log")
  assert sigterm_when(proc, lambda: os.path.exists(metrics) and read_metrics(killed)) == 0
  reached = read_metrics(killed)[-1]["step"]
  assert reached < 4
  assert checkpoint.Checkpointer(os.path.join(killed, "checkpoints")).latest_step() == reached
  log = (tmp_path / "first.log").read_text()
  assert "SIGTERM received" in log and f"after step {reached}/4" in log
  assert launch(config, killed, tmp_path / "second.log").wait(timeout=600) == 0
  assert f"at step {reached}" in (tmp_path / "second.log").read_text()
  rows = read_metrics(killed)
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for got, want in zip(rows, read_metrics(straight), strict=True):
    assert got["reward"] == want["reward"] and got["loss"] == want["loss"], (got, want)


@pytest.mark.slow
def test_sigterm_to_the_sft_launcher_saves_exits_0_and_the_rerun_matches(tmp_path):
  """launch/train.py (SFT, 8 steps, logging every step, checkpoint_every=100) gets SIGTERM once
  it logs step 2: it exits 0 with its latest checkpoint at the last step it logged; the rerun
  resumes there and its final parameters equal the uninterrupted run's."""
  import re
  config = tiny_config(job="sft", **{"sft.log_every": 1})
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  assert launch(config, straight, tmp_path / "straight.log").wait(timeout=600) == 0
  first_log = tmp_path / "first.log"
  proc = launch(config, killed, first_log)
  assert sigterm_when(proc, lambda: "sft step 2/8" in first_log.read_text()) == 0
  logged = [int(n) for n in re.findall(r"sft step (\d+)/8", first_log.read_text())]
  assert checkpoint.Checkpointer(os.path.join(killed, "checkpoints")).latest_step() == logged[-1]
  assert logged[-1] < 8 and "SIGTERM received" in first_log.read_text()
  assert launch(config, killed, tmp_path / "second.log").wait(timeout=600) == 0
  assert f"at step {logged[-1]}" in (tmp_path / "second.log").read_text()
  want_step, want = saved_params(os.path.join(straight, "checkpoints"))
  got_step, got = saved_params(os.path.join(killed, "checkpoints"))
  assert want_step == got_step == 8
  jax.tree.map(np.testing.assert_array_equal, got, want)
