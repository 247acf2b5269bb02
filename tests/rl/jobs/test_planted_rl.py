"""A reward model in the RL loop: configs/preference.py planted_rl shortened. A Bradley-Terry RM
trained on the planted pairs (the chosen response ends with "thanks") is the only reward of the
general prompts; the SFT policy samples the ending at ~5% but never shows it greedily, and RL
must raise the rate at which greedy responses to held-out prompts (domain "planted", graded by
the planted rule through the trainer's held-out evaluation) end with it. The rate goes 0 -> 1.0
in 40 steps on seeds 0, 1, 2 (docs/rewards.md); with the RM's score negated, or a constant
reward, this test fails. About 150 s on the 2-core CPU host (the BT job, 160 SFT steps and 20 RL
steps, each compiled), hence slow."""

import ml_collections
import pytest

import launch.jobs
from configs import preference as preference_config
from rl.jobs import preference, sft_then_rl

from tests.rl.jobs.test_preference_jobs import job_config, write_pairs

RL_STEPS = 20


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
  """(root, BT RM workdir): the RM trained on the planted pairs (as test_preference_jobs does),
  and the policy's prompt records in root."""
  root = tmp_path_factory.mktemp("planted_rl")
  train, heldout = write_pairs(root)
  launch.jobs.run_job(job_config("bt_rm", train, heldout, steps=40), str(root / "bt"))
  preference.save_records(root / "train.jsonl",
                          preference.make_planted_records(512, 0, marker_rate=0.05))
  preference.save_records(root / "heldout.jsonl",
                          preference.make_planted_records(64, 1, marker_rate=0.0, heldout=True))
  return root


def planted_config(root) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(preference_config.get_config("planted_rl").to_dict())
  c.data.train_files = str(root / "train.jsonl")
  c.data.heldout_files = str(root / "heldout.jsonl")
  c.reward.bt_dir = str(root / "bt")
  c.train.steps = RL_STEPS
  c.train.eval_every = 0
  c.train.checkpoint_every = RL_STEPS
  return c


@pytest.mark.slow
def test_rm_only_rl_raises_the_heldout_property_rate(planted):
  results = sft_then_rl.run_sft_then_rl(planted_config(planted), str(planted / "run"))
  before = results["sft_heldout_by_domain"]["acc/planted"]
  after = results["rl_heldout_by_domain"]["acc/planted"]
  assert results["sft_heldout_acc"] == before  # every held-out prompt is a planted one
  assert before <= 0.1, results
  assert after >= before + 0.4, results
