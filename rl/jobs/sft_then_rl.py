"""The multi-stage job (config.job="sft_rl"): SFT cold start, then RL from the SFT checkpoint,
then a held-out comparison of both checkpoints (table, results.json and a learning-curve PNG).

Each stage lives in its own sub-directory of the workdir (local or remote, through
etils.epath); a finished SFT stage is not rerun, and an interrupted SFT or RL stage resumes from
its latest checkpoint, so rerunning the same command continues where it stopped. A stage stopped
by SIGTERM / SIGINT raises Preempted out of here (no results are written). results.json's
wall_s is the whole run's, every leg included (each stage keeps its own in its checkpoints).
"""

from __future__ import annotations

import io
import json
import os

import ml_collections
from absl import logging
from etils import epath

from rl.config.describe import describe_rl
from rl.jobs import sft
from rl.jobs.checkpoint import workdir_path
from rl.jobs.trainer import Trainer


def plot_learning_curve(metrics_path: str | os.PathLike, out_path: str | os.PathLike, *,
                        sft_acc: float) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [json.loads(line) for line in epath.Path(metrics_path).read_text().splitlines()]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot([r["step"] for r in rows], [r["acc"] for r in rows], label="train accuracy",
          alpha=0.6)
  evals = [r for r in rows if "heldout_acc" in r]
  ax.plot([0] + [r["step"] for r in evals], [sft_acc] + [r["heldout_acc"] for r in evals],
          "o-", label="held-out accuracy (greedy)")
  ax.set_xlabel("RL step")
  ax.set_ylabel("accuracy")
  ax.set_ylim(0, 1)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=100)
  plt.close(fig)
  epath.Path(out_path).write_bytes(png.getvalue())


def run_sft_then_rl(config: ml_collections.ConfigDict, workdir: str | os.PathLike, *,
                    allow_config_change: bool = False) -> dict:
  """Runs (or resumes) both stages and the comparison; `allow_config_change`: a stage may resume
  under a config other than the one it ran with (checkpoint.save_run_config). Every progress
  line says which of the two stages it belongs to ("[stage 1/2] sft step ...", "[stage 2/2]
  step ..."), with that stage's ETA."""
  workdir = workdir_path(workdir)
  sft_dir = workdir / "sft"
  logging.info("stage 1/2: SFT in %s", sft_dir)
  # Returns at once when the stage is done.
  sft_metrics = sft.run(config, sft_dir, allow_config_change=allow_config_change,
                        job_stage="stage 1/2")
  rl_config = ml_collections.ConfigDict(config.to_dict())
  rl_config.init_checkpoint = os.fspath(sft_dir / "checkpoints")
  rl_config.job = "rl"
  logging.info("stage 2/2: RL (%s, %d steps) in %s", describe_rl(config), config.train.steps,
               workdir / "rl")
  trainer = Trainer(rl_config, workdir / "rl", allow_config_change=allow_config_change,
                    job_stage="stage 2/2")
  sft_eval_path = sft_dir / "heldout.json"
  if not sft_eval_path.exists():
    if trainer.leg.start_step:
      raise RuntimeError(f"{sft_eval_path} is missing but RL already started: remove "
                         f"{workdir} to start over")
    sft_eval_path.write_text(json.dumps({"heldout_acc": trainer.evaluate(),
                                         "heldout_by_domain": trainer.heldout_by_domain}))
  sft_eval = json.loads(sft_eval_path.read_text())
  sft_acc = sft_eval["heldout_acc"]
  logging.info("SFT checkpoint held-out accuracy: %.3f", sft_acc)
  trainer.run()
  rl_acc = trainer.evaluate()
  results = {"sft_heldout_acc": sft_acc, "rl_heldout_acc": rl_acc,
             # per domain (acc/<domain>): e.g. a mixed run's addition and planted rates
             "sft_heldout_by_domain": sft_eval.get("heldout_by_domain", {}),
             "rl_heldout_by_domain": trainer.heldout_by_domain,
             "heldout_size": len(trainer.task.heldout_entries),
             "wall_s": sft_metrics["sft/wall_s"] + trainer.wall_s(),
             "algorithm": describe_rl(config), "task": config.data.task}
  (workdir / "results.json").write_text(json.dumps(results, indent=1))
  plot_learning_curve(workdir / "rl" / "metrics.jsonl", workdir / "learning_curve.png",
                      sft_acc=sft_acc)
  table = (f"\n| checkpoint | held-out accuracy ({results['heldout_size']} problems) |\n"
           f"| --- | --- |\n| SFT | {sft_acc:.3f} |\n| RL ({results['algorithm']}) | {rl_acc:.3f} |\n"
           f"wall time {results['wall_s']:.0f} s; results in {workdir}/results.json")
  print(table)
  return results

