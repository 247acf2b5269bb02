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

Then RL with that BT RM as the only reward of general prompts (SFT, then Dr. GRPO; seeds 0, 1,
2 in docs/rewards.md):

  python -c "from rl.jobs import preference as p; \
      p.save_records('/tmp/planted_policy_train.jsonl', \
                     p.make_planted_records(512, 0, marker_rate=0.05)); \
      p.save_records('/tmp/planted_policy_heldout.jsonl', \
                     p.make_planted_records(64, 1, marker_rate=0.0, heldout=True))"
  python launch/train.py --config=configs/preference.py:planted_rl --workdir=/tmp/planted_rl \
      --config.data.train_files=/tmp/planted_policy_train.jsonl \
      --config.data.heldout_files=/tmp/planted_policy_heldout.jsonl \
      --config.reward.bt_dir=/tmp/planted_bt

One policy on two domains, additions graded by the verifier beside the same general prompts
scored by the BT RM (SFT on both, then DeepSeek-V3.2 GRPO; docs/rewards.md):

  python -c "from rl.jobs import preference as p; \
      p.save_records('/tmp/mixed_train.jsonl', p.make_mixed_records(8000, 2000, 0)); \
      p.save_records('/tmp/mixed_heldout.jsonl', p.make_mixed_records(500, 64, 1, heldout=True))"
  python launch/train.py --config=configs/preference.py:mixed_rl --workdir=/tmp/mixed_rl \
      --config.data.train_files=/tmp/mixed_train.jsonl \
      --config.data.heldout_files=/tmp/mixed_heldout.jsonl --config.reward.bt_dir=/tmp/planted_bt

The first line writes the planted-preference pairs (rl/jobs/preference.py
make_planted_preferences): general prompts whose chosen response ends with the word "thanks"
and whose rejected one ends with another word of that length. The argument picks the job:
"bt_rm" (a Bradley-Terry RM, scalar head), "genrm" (a pairwise generative RM, LM head) or "dpo"
(LM head); each writes checkpoints, metrics.jsonl and the held-out pairwise accuracy, and a
bt_rm / genrm workdir is what config.reward.bt_dir / genrm_dir reads in an RL run. The model is
tiny_dense with the byte tokenizer; the pair files are the user's to name. "planted_rl" fine-tunes
a policy on general prompts whose responses end with "thanks" 5% of the time (it samples the
ending, greedy decoding never shows it), then runs RL where those prompts are scored only by the
RM; its held-out prompts (domain "planted", rl/rewards/planted.py) report the property rate of
greedy responses as `heldout_acc/planted` and in results.json (`*_heldout_by_domain`).
"mixed_rl" adds the demo's additions to them (`heldout_acc/addition`).
"""

from configs import demo
from rl.config.defaults import base_config

JOBS = {"bt_rm": "scalar", "genrm": "lm", "dpo": "lm"}  # job: model head
# SFT then RL: on the planted task, general prompts scored by an RM; and mixed, additions
# graded by the verifier beside those general prompts.
RL = ("planted_rl", "mixed_rl")


def get_config(arg: str = "bt_rm"):
  if arg not in (*JOBS, *RL):
    raise ValueError(f"configs/preference.py:{arg}: the argument must be one of "
                     f"{[*JOBS, *RL]}")
  if arg == "planted_rl":
    return planted_rl_config()
  if arg == "mixed_rl":
    return mixed_rl_config()
  c = base_config(preset="tiny_dense", head=JOBS[arg])
  c.job = arg
  c.preference.steps = {"bt_rm": 40, "genrm": 60, "dpo": 40}[arg]
  c.sft.batch_size = 16
  c.sft.lr = 2e-3 if arg == "genrm" else 1e-3
  c.sft.log_every = 10
  c.sft.checkpoint_every = 20
  return c.lock()


def planted_rl_config():
  """SFT on planted records whose responses end with the marker at a low rate (the policy
  samples it, greedy decoding does not show it), then RL where the general prompts are scored
  only by the Bradley-Terry RM of config.reward.bt_dir; held-out prompts of domain "planted"
  report the property rate (the trainer's greedy held-out evaluation, `heldout_acc/planted`)."""
  c = base_config(preset="tiny_dense", head="lm")
  c.job = "sft_rl"
  c.data.source = "files"
  c.reward.graders = "general=bt"
  c.rollout.max_new_tokens = 64
  c.sft.epochs = 10  # 160 steps: held-out SFT loss ~0.18 (the sentences, not yet the subject)
  c.sft.batch_size = 32
  c.sft.lr = 3e-3
  c.sft.log_every = 40
  c.sft.checkpoint_every = 160
  # The RM scores every sample of a group, so a group without the property still has small
  # score differences: GRPO's division by the group's std blew them up into full advantages and
  # the sentences fell apart in 20 steps (lr 2e-4); Dr. GRPO (mean only), a KL of 0.1 to the
  # SFT policy and sampling at temperature 0.7 (fewer typos for the RM to reward) kept them.
  c.rl.estimator = "dr_grpo"
  c.rl.kl_coef = 0.1
  c.rollout.temperature = 0.7
  c.train.steps = 40
  c.train.prompts_per_step = 8
  c.train.samples_per_prompt = 8
  c.train.log_every = 5
  c.train.eval_every = 10
  c.train.checkpoint_every = 20
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 2
  return c.lock()


def mixed_rl_config():
  """One policy, two domains (rl/jobs/preference.py make_mixed_records): the demo's model and
  two-digit additions (graded by the puzzle verifier) beside the planted general prompts
  (scored only by the Bradley-Terry RM of config.reward.bt_dir), SFT on both, then DeepSeek-V3.2
  GRPO. The held-out evaluation reports each domain: `heldout_acc/addition` (additions solved)
  and `heldout_acc/planted` (the property rate)."""
  c = demo.get_config("grpo_v32")
  c.data.source = "files"
  c.sft.carry_slip_rate = 0.0  # the training records carry the teacher's slips already
  c.reward.graders = "general=bt"
  c.rollout.max_new_tokens = 64  # the planted sentences run to ~50 bytes
  c.rollout.prompt_bucket = 32
  # What planted_rl found for RM-scored prompts: a KL of 0.1 to the SFT policy and sampling at
  # temperature 0.7 keep the sentences whole; the additions keep grpo_v32's KL.
  c.rl.kl_coef_per_domain = "general=0.1"
  c.rollout.temperature = 0.7
  return c
