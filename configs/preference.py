"""Reward models and DPO on preference pairs (rl/jobs/preference_jobs.py), tiny and on CPU.

  python -c "from rl.jobs import preference as p; \
      p.save_preferences('/tmp/planted_train.jsonl', p.make_planted_preferences(256, 0)); \
      p.save_preferences('/tmp/planted_heldout.jsonl', p.make_planted_preferences(64, 1))"
  python launch/train.py --config=configs/preference.py:bt_rm --workdir=/tmp/planted_bt \
      --config.preference.train_files=/tmp/planted_train.jsonl \
      --config.preference.heldout_files=/tmp/planted_heldout.jsonl
  python launch/train.py --config=configs/preference.py:genrm --workdir=/tmp/planted_genrm \
      --config.preference.train_files=/tmp/planted_train.jsonl \
      --config.preference.heldout_files=/tmp/planted_heldout.jsonl
  python launch/train.py --config=configs/preference.py:dpo --workdir=/tmp/planted_dpo \
      --config.preference.train_files=/tmp/planted_train.jsonl \
      --config.preference.heldout_files=/tmp/planted_heldout.jsonl

The first line writes the planted-preference pairs (rl/jobs/preference.py
make_planted_preferences): general prompts whose chosen response ends with the word "thanks"
and whose rejected one ends with another word of that length. The argument picks the job:
"bt_rm" (a Bradley-Terry RM, scalar head), "genrm" (a pairwise generative RM, LM head) or "dpo"
(LM head); each writes checkpoints, metrics.jsonl and the held-out pairwise accuracy, and a
bt_rm / genrm workdir is what config.reward.bt_dir / genrm_dir reads in an RL run. The model is
tiny_dense with the byte tokenizer; the pair files are the user's to name.
"""

from rl.config.defaults import base_config

JOBS = {"bt_rm": "scalar", "genrm": "lm", "dpo": "lm"}  # job: model head


def get_config(arg: str = "bt_rm"):
  if arg not in JOBS:
    raise ValueError(f"configs/preference.py:{arg}: the argument must be one of {list(JOBS)}")
  c = base_config(preset="tiny_dense", head=JOBS[arg])
  c.job = arg
  c.preference.steps = {"bt_rm": 40, "genrm": 60, "dpo": 40}[arg]
  c.sft.batch_size = 16
  c.sft.lr = 2e-3 if arg == "genrm" else 1e-3
  c.sft.log_every = 10
  c.sft.checkpoint_every = 20
  return c.lock()
