"""Rejection sampling with the rollout engine: N samples per training prompt from a checkpoint,
graded by the run's verifiers, the correct ones written as an SFT dataset.

  python launch/rejection_sample.py --config=configs/demo.py \
      --checkpoint=workdir/demo/sft/checkpoints --n=8 --out=/tmp/rs_arith.jsonl
  # then SFT on the kept responses (records with a "response" are SFT targets):
  python launch/train.py --config=configs/demo.py --config.job=sft \
      --config.data.source=files --config.data.train_files=/tmp/rs_arith.jsonl \
      --config.data.heldout_files=<held-out prompt records>

The prompts are the config's training entries (config.data: generated puzzles or prompt-record
files) under its prompt template; sampling uses config.rollout (temperature, top-p, length) and
the grading is rl/rewards/manager.py (puzzle verifier, math verifier or code sandbox by record).
Each written line is the prompt record plus the kept "response" (rl/data/selection.py), so the
file is a prompt-record file SFT and the trainer read back.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import logs  # noqa: E402
from rl.data.rejection import sample_and_keep  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config that built the checkpoint's "
                                          "model and names the prompts (configs/*.py[:arg]).",
                                          lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "Orbax checkpoint directory of ours "
                                  "(<workdir>/checkpoints, or a workdir holding one).")
_N = flags.DEFINE_integer("n", 8, "Samples per prompt.")
_OUT = flags.DEFINE_string("out", None, "Output jsonl (prompt records with a kept response).")
_LIMIT = flags.DEFINE_integer("limit", 0, "First N training prompts only (0: all).")
_BATCH = flags.DEFINE_integer("batch_prompts", 64, "Prompts per rollout call.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  for name, value in (("config", _CONFIG.value), ("checkpoint", _CHECKPOINT.value),
                      ("out", _OUT.value)):
    if not value:
      raise app.UsageError(f"--{name} is required")
  stats = sample_and_keep(_CONFIG.value, _CHECKPOINT.value, n=_N.value, out_path=_OUT.value,
                          limit=_LIMIT.value, batch_prompts=_BATCH.value, seed=_SEED.value)
  print(f"kept {stats['kept']} of {stats['total']} responses; {stats['prompts_with_correct']} "
        f"of {stats['prompts']} prompts solved -> {_OUT.value}")


if __name__ == "__main__":
  logs.setup()
  app.run(main)
