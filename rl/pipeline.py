"""Multi-stage jobs: SFT cold start, then RL from the SFT checkpoint, then a held-out
comparison of both checkpoints (table, results.json and a learning-curve PNG).

Each stage lives in its own sub-directory of the workdir; a finished SFT stage is not rerun and
an interrupted RL stage resumes from its latest checkpoint, so rerunning the same command
continues where it stopped.
"""

from __future__ import annotations

import json
import os
import time

import ml_collections
from absl import logging

from rl import sft
from rl.checkpoint import Checkpointer
from rl.trainer import Trainer


def plot_learning_curve(metrics_path: str, out_path: str, *, sft_acc: float, task: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = [json.loads(line) for line in open(metrics_path)]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot([r["step"] for r in rows], [r[f"acc/{task}"] for r in rows], label="train accuracy",
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
  fig.savefig(out_path, dpi=100)
  plt.close(fig)


def run_sft_then_rl(config: ml_collections.ConfigDict, workdir: str) -> dict:
  t0 = time.perf_counter()
  sft_dir = os.path.join(workdir, "sft")
  sft_ckpt = os.path.join(sft_dir, "checkpoints")
  if os.path.isdir(sft_ckpt) and Checkpointer(sft_ckpt).latest_step() is not None:
    logging.info("SFT stage already done: %s", sft_ckpt)
  else:
    sft.run(config, sft_dir)
  rl_config = ml_collections.ConfigDict(config.to_dict())
  rl_config.init_checkpoint = sft_ckpt
  rl_config.job = "rl"
  trainer = Trainer(rl_config, os.path.join(workdir, "rl"))
  sft_eval_path = os.path.join(sft_dir, "heldout.json")
  if not os.path.exists(sft_eval_path):
    if trainer.start_step:
      raise RuntimeError(f"{sft_eval_path} is missing but RL already started: remove "
                         f"{workdir} to start over")
    with open(sft_eval_path, "w") as f:
      json.dump({"heldout_acc": trainer.evaluate()}, f)
  with open(sft_eval_path) as f:
    sft_acc = json.load(f)["heldout_acc"]
  logging.info("SFT checkpoint held-out accuracy: %.3f", sft_acc)
  trainer.run()
  rl_acc = trainer.evaluate()
  results = {"sft_heldout_acc": sft_acc, "rl_heldout_acc": rl_acc,
             "heldout_size": len(trainer.heldout_entries),
             "wall_s": time.perf_counter() - t0, "algorithm": config.rl.algorithm,
             "task": config.data.task}
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  plot_learning_curve(os.path.join(workdir, "rl", "metrics.jsonl"),
                      os.path.join(workdir, "learning_curve.png"), sft_acc=sft_acc,
                      task=config.data.task)
  table = (f"\n| checkpoint | held-out accuracy ({results['heldout_size']} problems) |\n"
           f"| --- | --- |\n| SFT | {sft_acc:.3f} |\n| RL ({config.rl.algorithm}) | {rl_acc:.3f} |\n"
           f"wall time {results['wall_s']:.0f} s; results in {workdir}/results.json")
  print(table)
  return results
