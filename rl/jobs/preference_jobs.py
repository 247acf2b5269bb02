"""The preference jobs a launcher runs: config.job "bt_rm" (a Bradley-Terry reward model),
"genrm" (a pairwise generative RM answering YES / NO, each pair asked in both orders) or "dpo",
trained on config.preference's pair files with checkpoints, exact resume, metrics.jsonl and a
held-out pairwise accuracy, as the SFT job (rl/jobs/sft.py) runs with its held-out loss.

The objectives and their held-out metrics are rl/jobs/preference.py's tasks (`bt_task`,
`judge_task`, `dpo_task`); the optimiser is AdamW at config.sft.lr, constant. The held-out
pairwise accuracy is the share of held-out pairs the model orders right: BT, the chosen
response's reward strictly above the rejected one's; GenRM, P(YES) averaged over both orders
above 0.5; DPO, the implicit reward margin above 0.

Checkpoints `{"params", "rest", "opt_state"}` go to <workdir>/checkpoints every
config.sft.checkpoint_every steps and at the end; the final one's record holds the held-out
accuracy, which is how a finished job is recognised (it is not rerun). The batch order is a
function of the seed and the step, so a resumed run ends with the parameters an uninterrupted
one ends with. DPO's reference is the initial policy, rebuilt on resume from the same source
(config.init_checkpoint, config.init_hf_dir or the seed's init). The workdir is what
config.reward.bt_dir / genrm_dir reads (rl/jobs/reward_models.py).

The model is trained on one device, unsharded (config.mesh is not read): reward models beyond a
device's memory need the trainer's placement, which these jobs do not yet use.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from models.tokenizer import load_tokenizer
from rl.config.validation import PREFERENCE_HEADS, check_paths, validate
from rl.core.checks import InputError
from rl.core.policy import build_policy
from rl.jobs import evaluation, fitting, preference
from rl.jobs.checkpoint import Checkpointer, MetricsWriter, PreemptionGuard, open_stage
from rl.jobs.progress import Progress
from rl.rewards.genrm import split_model


def load_pairs(c: ml_collections.ConfigDict, field: str) -> list[preference.PreferencePair]:
  """The pairs of config.preference.<field>; bad rows fail naming file:line (parquet: file row
  N) and the field, or are skipped and counted with config.data.skip_bad_records."""
  paths = c.preference[field]
  pairs, skipped = preference.load_preferences(paths.split(","),
                                               skip_bad=c.data.skip_bad_records)
  if skipped:
    logging.warning("config.preference.%s: skipped %d bad row(s), kept %d", field, skipped,
                    len(pairs))
  if not pairs:
    raise InputError(f"config.preference.{field}={paths!r}: no preference pairs")
  return pairs


def initial_model(c: ml_collections.ConfigDict):
  """The model the job starts from: config.init_checkpoint (one of our checkpoints, e.g. SFT's),
  else config.init_hf_dir or a random init (build_policy)."""
  if c.init_checkpoint:
    return evaluation.load_policy_checkpoint(c, c.init_checkpoint)[0]
  return build_policy(c)


def make_task(c: ml_collections.ConfigDict, model, tokenizer,
              train: list[preference.PreferencePair],
              heldout: list[preference.PreferencePair]) -> preference.PreferenceTask:
  """The objective of config.job on `model` (its current parameters are DPO's reference)."""
  batch_size = c.sft.batch_size
  if c.job == "bt_rm":
    return preference.bt_task(model, tokenizer, train, heldout, batch_size=batch_size)
  if c.job == "genrm":
    # Judge prompts without the chat template: config.reward's GenRM grader asks them so.
    return preference.judge_task(model, tokenizer, preference.judge_examples(train), heldout,
                                 batch_size=batch_size)
  return preference.dpo_task(model, tokenizer, train, heldout, beta=c.preference.beta,
                             batch_size=batch_size)


def resume(ckpt: Checkpointer, name: str, task: preference.PreferenceTask, state: dict):
  """(start step, (params, rest, opt_state), held-out metrics before training (`..._start`),
  wall time of the earlier legs): the latest checkpoint's, or step 0's with the held-out
  metrics of the initial `state`'s parameters."""
  latest = ckpt.restore_latest(state)
  if latest is None:
    logging.info("%s: held-out metrics before training...", name)
    metrics = {f"{name}/{k}_start": v for k, v in task.heldout(state["params"]).items()}
    return 0, (state["params"], state["rest"], state["opt_state"]), metrics, 0.0
  start_step, restored, record = latest
  logging.info("%s resumed from %s at step %d", name, ckpt.directory, start_step)
  return (start_step, (restored["params"], restored["rest"], restored["opt_state"]),
          {k: v for k, v in record.items() if k.endswith("_start")}, record[f"{name}/wall_s"])


def run(config: ml_collections.ConfigDict, workdir: str, *,
        allow_config_change: bool = False) -> dict[str, float]:
  """Trains (or resumes) config.job's preference objective in `workdir`; returns its metrics,
  named "<job>/...": the held-out metrics before (`..._start`) and after training, the last
  logged training loss and the wall time. <workdir>/metrics.jsonl and TensorBoard get the
  held-out metrics at step 0 and at the end and, every config.sft.log_every steps, the training
  loss and accuracy."""
  t_leg = time.perf_counter()
  c = config
  validate(c)
  if c.job not in PREFERENCE_HEADS:
    raise InputError(f"config.job={c.job!r}: not a preference job ({', '.join(PREFERENCE_HEADS)})")
  check_paths(c)
  s, name = c.sft, c.job
  workdir, ckpt, done = open_stage(c, workdir, save_every=s.checkpoint_every,
                                   allow_config_change=allow_config_change,
                                   final_key=f"{name}/heldout_accuracy", what=f"{name} job")
  if done is not None:
    return done
  tokenizer = load_tokenizer(c.tokenizer)
  train, heldout = load_pairs(c, "train_files"), load_pairs(c, "heldout_files")
  model = initial_model(c)
  task = make_task(c, model, tokenizer, train, heldout)
  graphdef, params, rest = split_model(model)
  optimizer, step_fn = fitting.objective_step(task.objective, graphdef, s.lr, s.weight_decay,
                                                 s.grad_clip, task.static)
  params = jax.tree.map(jnp.copy, params)  # donated by the step
  opt_state = optimizer.init(params)

  start_step, (params, rest, opt_state), metrics, wall_s_before = resume(
      ckpt, name, task, {"params": params, "rest": rest, "opt_state": opt_state})
  writer = MetricsWriter(workdir, resume_step=start_step)
  if not start_step:
    writer.write(0, {k[:-len("_start")]: v for k, v in metrics.items()})

  def save(step: int, *, force: bool = False, **final) -> None:
    ckpt.save(step, {"params": params, "rest": rest, "opt_state": opt_state},
              {"step": step, **metrics, **final,
               f"{name}/wall_s": wall_s_before + time.perf_counter() - t_leg}, force=force)

  total = c.preference.steps
  logging.info("%s: %d training pairs, %d held out, %d steps of %d pairs; held-out accuracy "
               "%.3f at step 0", name, len(train), len(heldout), total, s.batch_size,
               metrics[f"{name}/heldout_accuracy_start"])
  batches = fitting.batch_indices(len(next(iter(task.data.values()))), s.batch_size, c.seed)
  for _ in range(start_step):  # the order is the seed's: skip what ran before the restart
    next(batches)
  progress = Progress(total, start=start_step)
  row: dict[str, float] = {}
  with PreemptionGuard() as preemption:
    for step in range(start_step + 1, total + 1):
      index = next(batches)
      params, opt_state, loss, aux = step_fn(params, opt_state, rest,
                                             {k: v[index] for k, v in task.data.items()})
      if step % s.log_every == 0 or step == total:
        row = {f"{name}/train_loss": float(loss),
               **{f"{name}/train_{k}": float(v) for k, v in aux.items()}}
        logging.info("%s%s step %d/%d loss %.4f %s", progress.prefix, name, step, total,
                     row[f"{name}/train_loss"], progress.suffix(step))
        if step < total:  # the last step's row also holds the final held-out metrics
          writer.write(step, row)
      if step < total:  # the last step's checkpoint is the final one, with its metrics
        save(step)
        preemption.stop_if_requested(name, step, total, save, ckpt, writer)
  final = {f"{name}/{k}": v for k, v in task.heldout(params).items()}
  logging.info("%s done: held-out accuracy %.3f -> %.3f", name,
               metrics[f"{name}/heldout_accuracy_start"], final[f"{name}/heldout_accuracy"])
  writer.write(total, {**row, **final})
  writer.close()
  save(total, force=True, **row, **final)
  ckpt.close()
  return {**metrics, **row, **final, f"{name}/wall_s": wall_s_before + time.perf_counter() - t_leg}
