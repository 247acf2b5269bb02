"""Prompt selection with the rollout engine: N samples per training prompt from a checkpoint,
graded by the run's verifiers, then one rule (--rule) writes a prompt-record file.

  python launch/select_prompts.py --config=configs/demo.py \
      --checkpoint=workdir/demo/sft/checkpoints --rule=rejection --n=8 --out=/tmp/rs_arith.jsonl
  # then SFT on the kept responses (records with a "response" are SFT targets):
  python launch/train.py --config=configs/demo.py --config.job=sft \
      --config.data.source=files --config.data.train_files=/tmp/rs_arith.jsonl \
      --config.data.heldout_files=<held-out prompt records> --config.sft.carry_slip_rate=0
  # or keep the prompts the checkpoint does not always solve, and run RL on them:
  python launch/select_prompts.py --config=configs/demo.py \
      --checkpoint=workdir/demo/sft/checkpoints --rule=worst_of_n --n=8 --out=/tmp/hard.jsonl
  python launch/train.py --config=configs/demo.py --config.job=rl \
      --config.init_checkpoint=workdir/demo/sft/checkpoints --config.data.source=files \
      --config.data.train_files=/tmp/hard.jsonl --config.data.heldout_files=<held-out records> \
      --config.sft.carry_slip_rate=0

Rules (rl/jobs/select_prompts.py, their sources in rl/data/selection.py):
  rejection     each verified response, unique per prompt, as an SFT record ("response" added);
  worst_of_n    the prompts that not every sample solves (Seed-Thinking-v1.5's RL data cleaning);
  low_variance  the prompts whose sample accuracies vary (offline DAPO dynamic sampling);
  audit         the math prompts whose samples agree (share >= --audit_threshold) on a final
                answer other than the reference, with their "sampled_answers", for a human to
                check (Seed-Thinking-v1.5's reference cleaning); the count is logged;
  pre_ppo       the RLHF data-scaling study's Pre-PPO: each prompt's mean score over its n
                samples under config.reward's graders (e.g. --config.reward.graders=
                general=genrm --config.reward.genrm_dir=<genrm job workdir>), z-normalised per
                domain; the lowest --fraction is kept and written merged with the original
                set (every prompt once, the kept ones a second time, marked "pre_ppo").
  best_of_n_reference
                each prompt with its best-scored sample as "reference" (and
                "reference_score"): the study's best-of-N reference, scored by a
                Bradley-Terry RM (--config.reward.graders=general=bt
                --config.reward.bt_dir=<bt_rm job workdir>), for a pairwise GenRM to judge
                against in RL (general=genrm).

The prompts are the config's training entries (config.data: generated puzzles or prompt-record
files) under its prompt template; sampling uses config.rollout (temperature, top-p, length) and
the grading is rl/rewards/manager.py (puzzle verifier, math verifier or code sandbox by record).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import cli, logs  # noqa: E402
from rl.jobs.select_prompts import RULES, sample_and_select  # noqa: E402

_CONFIG = cli.define(config_flags.DEFINE_config_file, "config", None, "Config that built the checkpoint's "
                                          "model and names the prompts (configs/*.py[:arg]).",
                                          lock_config=True)
_CHECKPOINT = cli.define(flags.DEFINE_string, "checkpoint", None, "Orbax checkpoint directory of ours "
                                  "(<workdir>/checkpoints, or a workdir holding one).")
_RULE = flags.DEFINE_enum("rule", "rejection", RULES, "Selection rule (see above).")
_N = flags.DEFINE_integer("n", 8, "Samples per prompt.")
_OUT = cli.define(flags.DEFINE_string, "out", None, "Output jsonl of prompt records.")
_LIMIT = cli.define(flags.DEFINE_integer, "limit", 0, "First N training prompts only (0: all).")
_BATCH = flags.DEFINE_integer("batch_prompts", 64, "Prompts per rollout call.")
_SEED = cli.define(flags.DEFINE_integer, "seed", 0, "Sampling seed.")
_AUDIT_THRESHOLD = flags.DEFINE_float("audit_threshold", 0.8, "--rule=audit: the share of "
                                      "samples the majority answer needs to flag a prompt.")
_FRACTION = flags.DEFINE_float("fraction", 0.1, "--rule=pre_ppo: the share of prompts kept "
                               "(the lowest per-domain-normalised scores).")


def main(argv):
  cli.no_arguments(argv)
  for name, value in (("config", _CONFIG.value), ("checkpoint", _CHECKPOINT.value),
                      ("out", _OUT.value)):
    if not value:
      raise app.UsageError(f"--{name} is required")
  stats, _ = sample_and_select(_CONFIG.value, _CHECKPOINT.value, rule=_RULE.value, n=_N.value,
                               out_path=_OUT.value, limit=_LIMIT.value,
                               batch_prompts=_BATCH.value, seed=_SEED.value,
                               audit_threshold=_AUDIT_THRESHOLD.value,
                               fraction=_FRACTION.value)
  if _RULE.value == "pre_ppo":
    print(f"pre_ppo: wrote {stats['written']} prompts -> {_OUT.value}: the {stats['prompts']} "
          f"prompts once, the {stats['written'] - stats['prompts']} lowest-scored once more")
    return
  what = "responses" if _RULE.value == "rejection" else "prompts"
  print(f"{_RULE.value}: wrote {stats['written']} {what} -> {_OUT.value}; {stats['correct']} of "
        f"{stats['samples']} samples correct, {stats['prompts_with_correct']} of "
        f"{stats['prompts']} prompts solved at least once, {stats['prompts_all_correct']} always")


if __name__ == "__main__":
  logs.setup()
  app.run(main)
