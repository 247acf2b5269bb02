"""What a run keeps in its workdir and how it survives a restart: orbax checkpoints of every
array of the training state plus a small JSON record (step, counters, curriculum state, wall
time), saved asynchronously every N steps with the latest K kept; the resolved config
(config.json, and config_history.jsonl of the resumes that changed it) and the check that a
resumed run is the same run; metrics.jsonl and
TensorBoard scalars; and preemption (SIGTERM / SIGINT: save at the next step boundary, exit).

A workdir is local or remote (`gs://bucket/run`): every path goes through etils.epath, which
orbax uses too, so a remote URI reaches the storage untouched (a local path is made absolute,
as orbax wants). Orbax commits a step only when it is complete (a rename locally, a commit file
on GCS), so a save killed half-way never damages the last good checkpoint; a step that is
complete but unreadable (a file truncated or lost afterwards) is skipped on resume with a log
line, and the previous step is restored. Restore goes through an abstract target (shapes,
dtypes and shardings of the current run), so a checkpoint can be restored onto another mesh.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import threading
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from rl.config.describe import leaves
from rl.core.checks import InputError
from rl.core.policy import model_config

# Python modules a gs:// workdir needs beyond this project's requirements: etils.epath reads
# and writes gs:// files through gcsfs (or TensorFlow's gfile), and orbax lists checkpoint
# steps on GCS through google-cloud-storage.
GS_MODULES = ({"gcsfs", "tensorflow"}, {"google.cloud.storage"})
# What an image installs for them (launch/xm_launch.py): the first choice of each.
GS_PACKAGES = ("gcsfs", "google-cloud-storage")


def is_remote(path: str | os.PathLike) -> bool:
  return "://" in os.fspath(path)


def _importable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # a parent package is missing
    return False


def workdir_path(path: str | os.PathLike) -> epath.Path:
  """`path` as an etils.epath.Path: a remote URI (gs://bucket/run) as it is, a local path made
  absolute. A gs:// path whose client libraries are missing is an InputError naming them."""
  if not is_remote(path):
    return epath.Path(os.path.abspath(os.fspath(path)))
  if os.fspath(path).startswith("gs://"):
    for choices in GS_MODULES:
      if not any(_importable(m) for m in choices):
        raise InputError(
            f"workdir {os.fspath(path)}: gs:// paths need the Python module "
            f"{' or '.join(sorted(choices))} (pip install "
            f"{' or '.join(sorted(m.replace('.', '-') for m in choices))})")
  return epath.Path(path)


# ======================================================================== Checkpoints

class Checkpointer:
  def __init__(self, directory: str | os.PathLike, *, keep: int = 2, save_every: int = 1):
    if keep < 1 or save_every < 1:
      raise ValueError(f"Checkpointer(keep={keep}, save_every={save_every}): both must be >= 1")
    self.directory = workdir_path(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every,
                                           enable_async_checkpointing=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self.unreadable: set[int] = set()  # complete steps that failed to restore

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state: Any, record: dict, *, force: bool = False) -> bool:
    """Saves if `step` is on the save interval (or `force`); a step already saved is kept,
    unless it failed to restore (it is replaced)."""
    if step in self.manager.all_steps():
      if step not in self.unreadable:
        return False
      self.manager.delete(step)
      self.unreadable.discard(step)
    return self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)), force=force)

  def restore(self, step: int, abstract_state: Any, *,
              partial: bool = False) -> tuple[Any, dict]:
    """Restores onto the shapes/dtypes/shardings of `abstract_state` (arrays or
    jax.ShapeDtypeStruct leaves); `partial`: the saved state may hold more (e.g. an SFT
    stage's optimiser state, which the RL run it starts does not read)."""
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    if partial:
      state_args = ocp.args.PyTreeRestore(
          item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
          partial_restore=True)
    else:
      state_args = ocp.args.StandardRestore(target)
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=state_args, record=ocp.args.JsonRestore()))
    return restored["state"], restored["record"]

  def record(self, step: int) -> dict:
    """The JSON record of `step` alone (no arrays are read)."""
    return self.manager.restore(step, args=ocp.args.Composite(
        record=ocp.args.JsonRestore()))["record"]

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
    """(step, state, record) of the newest step that restores, or None without checkpoints.
    A step that fails (a truncated or missing file) is logged and the one before it tried;
    the run then saves over it. If no step restores, the newest step's error is raised."""
    steps = sorted(self.manager.all_steps(), reverse=True)
    first_error = None
    for step in steps:
      try:
        state, record = self.restore(step, abstract_state)
      except Exception as e:  # noqa: BLE001  (orbax/tensorstore raise many kinds)
        first_error = first_error or e
        self.unreadable.add(step)
        logging.warning("checkpoint step %d in %s cannot be restored (%s: %s); falling back "
                        "to the step before it", step, self.directory, type(e).__name__,
                        " ".join(str(e).split())[:300])
        continue
      if self.unreadable:
        logging.warning("resuming from step %d of %s: the newer step(s) %s are unreadable and "
                        "will be saved over", step, self.directory, sorted(self.unreadable))
      return step, state, record
    if first_error is not None:
      raise first_error
    return None

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


# ======================================================================== Run config

def open_stage(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
               save_every: int, allow_config_change: bool, final_key: str,
               what: str) -> tuple[epath.Path, Checkpointer, dict[str, float] | None]:
  """A training stage's workdir and Checkpointer, its run config recorded (save_run_config),
  and, when the latest checkpoint holds `final_key` (only a stage's final checkpoint does), its
  metrics under that key's prefix: the stage is done and is not rerun (None otherwise)."""
  workdir = workdir_path(workdir)
  ckpt = Checkpointer(workdir / "checkpoints", keep=config.train.keep_checkpoints,
                      save_every=save_every)
  latest = ckpt.latest_step()
  save_run_config(workdir, config, step=latest, allow_change=allow_config_change)
  if latest is not None:
    record = ckpt.record(latest)
    if final_key in record:
      logging.info("%s already done: %s step %d", what, ckpt.directory, latest)
      ckpt.close()
      prefix = final_key.split("/")[0] + "/"
      return workdir, ckpt, {k: v for k, v in record.items() if k.startswith(prefix)}
  return workdir, ckpt, None


def _param_shapes(model: dict) -> dict[str, tuple]:
  """{parameter path: shape} of the policy a config.model section builds (abstractly)."""
  from flax import nnx

  from models.transformer import Transformer
  cfg = model_config(ml_collections.ConfigDict({"model": model}))
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
  return {"/".join(map(str, k)): tuple(v.get_value().shape)
          for k, v in nnx.state(abstract, nnx.Param).flat_state()}


# Fields a resumed run may change without --allow_config_change: how long it runs (the RL
# learning rate is constant after warm-up, so more steps do not change the earlier ones' schedule),
# how often it logs, evaluates and saves, and where it computes (the mesh, the kernels, the
# decode slots, optimiser offload, rematerialisation) - a checkpoint restores onto any mesh, and
# none of these changes a sample or a gradient. A name ending in "." covers a section.
RESUMABLE_FIELDS = ("train.steps", "train.log_every", "train.eval_every", "train.checkpoint_every",
                    "train.keep_checkpoints", "train.max_bad_steps", "sft.log_every",
                    "sft.checkpoint_every", "mesh.", "kernel_backend", "rollout.batch_size",
                    "rollout.prefill_batch", "optim.offload_state", "model.remat",
                    "model.remat_names")
HISTORY = "config_history.jsonl"


def config_changes(before: dict, now: dict) -> dict[str, tuple]:
  """{dotted field: (value before, value now)} of the fields two resolved configs (as JSON
  objects) differ in; a field only one of them has is None in the other."""
  b, n = leaves(before), leaves(now)
  return {k: (b.get(k), n.get(k)) for k in sorted(set(b) | set(n)) if b.get(k) != n.get(k)}


def _resumable(field: str) -> bool:
  return any(field == f or (f.endswith(".") and field.startswith(f)) for f in RESUMABLE_FIELDS)


def _listed(changes: dict[str, tuple]) -> str:
  return "; ".join(f"config.{k}={b!r} there, {n!r} now" for k, (b, n) in changes.items())


def save_run_config(workdir: str | os.PathLike, config: ml_collections.ConfigDict, *,
                    step: int | None, allow_change: bool = False) -> None:
  """Records the resolved config of a run starting in `workdir` (process 0): a fresh run
  (`step` None: no checkpoint to resume) writes <workdir>/config.json. A run resuming from
  checkpoint `step` is compared with the config the workdir last ran with (config.json, or the
  newest line of config_history.jsonl) first:
  - a model with other parameter shapes is refused (InputError naming every changed
    config.model field with both values): its checkpoints cannot be restored;
  - other changed fields outside RESUMABLE_FIELDS are refused the same way unless
    `allow_change` (launch/train.py --allow_config_change): a run is what its config says, so
    continuing one under another algorithm or learning rate must be asked for.
  A resume that changes anything appends {"step", "changed", "config"} to
  config_history.jsonl; config.json, the config of the run's first steps, is never rewritten."""
  workdir = workdir_path(workdir)
  path, history = workdir / "config.json", workdir / HISTORY
  now = json.loads(config.to_json_best_effort())
  rows = []
  if step is not None and path.exists():
    rows = history.read_text().splitlines() if history.exists() else []
    before = json.loads(rows[-1])["config"] if rows else json.loads(path.read_text())
    changed = config_changes(before, now)
    model = {k: v for k, v in changed.items() if k.startswith("model.")}
    if model and _param_shapes(before["model"]) != _param_shapes(now["model"]):
      raise InputError(
          f"{workdir} holds checkpoints of another model ({_listed(model)}): the parameter "
          "shapes differ, so it cannot be resumed. Use the original model settings or another "
          "--workdir.")
    refused = {k: v for k, v in changed.items() if not _resumable(k)}
    if refused and not allow_change:
      raise InputError(
          f"{workdir} was run with another config ({_listed(refused)}): resume it with the same "
          "config, pass --allow_config_change to continue it with this one (recorded in "
          f"{HISTORY}), or use another --workdir.")
    if not changed:
      return
    logging.warning("resuming %s at step %d with changed config (%s)", workdir, step,
                    _listed(changed))
    rows.append(json.dumps({"step": step, "changed": {k: list(v) for k, v in changed.items()},
                            "config": now}, sort_keys=True))
  if jax.process_index() == 0:
    workdir.mkdir(parents=True, exist_ok=True)
    if rows:
      history.write_text("".join(row + "\n" for row in rows))
    else:
      path.write_text(config.to_json_best_effort(indent=1, sort_keys=True) + "\n")


# ======================================================================== Metrics

class _RemoteEventFile:
  """A TensorBoard event file on remote storage: objects there cannot be appended to, so each
  flush rewrites it with everything written so far (as tensorboardX's own GCS writer does)."""

  def __init__(self, path: str):
    self.path = epath.Path(path)
    self.buffer = io.BytesIO()

  def write(self, data: bytes) -> None:
    self.buffer.write(data)

  def flush(self) -> None:
    self.path.write_bytes(self.buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _RemoteEventFiles:
  """tensorboardX writer factory for remote logdirs, through etils.epath."""

  def open(self, path: str) -> _RemoteEventFile:
    return _RemoteEventFile(path)

  def directory_check(self, path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)


def _row_step(line: str) -> float:
  """The step of a metrics.jsonl row; inf for a blank or torn one (a kill mid-write)."""
  try:
    return json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return float("inf")


class MetricsWriter:
  """metrics.jsonl + TensorBoard scalars in the workdir; only process 0 writes. A run that
  starts at `resume_step` first drops the rows of later steps (it runs them again, and a plot
  would show them twice); TensorBoard hides those steps' old events (purge_step)."""

  def __init__(self, workdir: str | os.PathLike, *, resume_step: int = 0):
    self.enabled = jax.process_index() == 0
    workdir = workdir_path(workdir)
    self.path = workdir / "metrics.jsonl"
    self.remote = is_remote(workdir)
    self.lines: list[str] = []
    self.tb = None
    if not self.enabled:
      return
    workdir.mkdir(parents=True, exist_ok=True)
    if self.path.exists():
      self.lines = [line + "\n" for line in self.path.read_text().splitlines()
                    if _row_step(line) <= resume_step]
      self.path.write_text("".join(self.lines))
    from tensorboardX import SummaryWriter, record_writer
    if self.remote:
      record_writer.register_writer_factory(os.fspath(workdir).split(":", 1)[0],
                                            _RemoteEventFiles())
    self.tb = SummaryWriter(os.fspath(workdir / "tb"), purge_step=resume_step + 1)

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self.enabled:
      return
    line = json.dumps({"step": step, **metrics}) + "\n"
    self.lines.append(line)
    if self.remote:  # remote objects cannot be appended to: rewrite the (small) file
      self.path.write_text("".join(self.lines))
    else:
      with self.path.open("a") as f:
        f.write(line)
    for k, v in metrics.items():
      self.tb.add_scalar(k, v, step)
    self.tb.flush()

  def close(self):
    if self.tb is not None:
      self.tb.close()


# ======================================================================== Preemption

class Preempted(Exception):
  """Raised by a training loop after saving the checkpoint that SIGTERM or SIGINT asked for;
  launch/train.py logs it and exits with status 0, and the same command resumes."""


class PreemptionGuard:
  """While entered, SIGTERM and SIGINT only set a flag (and put the previous handlers back,
  so a second signal acts at once); the loop asks `requested()` at each step boundary, saves
  and raises Preempted. With several processes the flag is agreed at that boundary (any
  process signalled stops them all at the same step). Signals are only caught on the main
  thread (Python's rule); elsewhere the guard does nothing."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self):
    self.received: str | None = None
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> PreemptionGuard:
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame) -> None:
    del frame
    self.received = signal.Signals(signum).name
    self._restore()
    logging.warning("%s received: saving a checkpoint at the end of this step, then exiting "
                    "(send it again to stop at once)", self.received)

  def _restore(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def __exit__(self, *exc) -> None:
    self._restore()

  def requested(self) -> bool:
    stop = self.received is not None
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      stop = bool(np.any(multihost_utils.process_allgather(np.int32(stop))))
    return stop

  def stop_if_requested(self, what: str, step: int, total: int, save: Callable[..., Any],
                        checkpointer: Checkpointer, writer: MetricsWriter) -> None:
    """At the boundary after `step` (not the last): when a stop was requested, saves that
    step's checkpoint (`save(step, force=True)`), closes the checkpointer and the metrics
    writer and raises Preempted naming `what` ("SFT", a job's name, "" for RL)."""
    if not self.requested():
      return
    save(step, force=True)
    checkpointer.close()
    writer.close()
    raise Preempted(f"{what + ' ' if what else ''}stopped by {self.received or 'another process'}"
                    f" after step {step}/{total}; checkpoint saved in {checkpointer.directory}: "
                    "rerun the same command to resume")
