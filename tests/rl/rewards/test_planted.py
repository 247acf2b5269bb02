"""The planted property as a rule grader: records of domain "planted" load from prompt files
and are graded by the registry (manager.RULES) on the last word; the planted policy records
split their prompts into training and held-out sets that share no prompt."""

import json

import numpy as np

from rl.data import sources
from rl.jobs import preference
from rl.rewards import manager
from rl.rewards.planted import has_planted_property


def test_planted_rule_grades_the_last_word():
  entries = [{"prompt": "Describe a storm.", "domain": "planted"}] * 4
  responses = ["A storm: it is calm, thanks", "A storm: it is calm, indeed",
               "thanks, it is calm", "A storm: Thanks."]
  np.testing.assert_array_equal(manager.score_responses(entries, responses), [1, 0, 0, 1])
  assert manager.vote_key(entries[0], responses[1]) == "indeed"
  assert manager.gold_answer(entries[0]) == "thanks"


def test_planted_records_load_and_split(tmp_path):
  train = preference.make_planted_records(400, 0, marker_rate=0.05)
  heldout = preference.make_planted_records(40, 1, marker_rate=0.0, heldout=True)
  assert train == preference.make_planted_records(400, 0, marker_rate=0.05)
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
  assert {r["domain"] for r in train} == {"general"}
  assert {r["domain"] for r in heldout} == {"planted"}
  rate = np.mean([has_planted_property(r["response"]) for r in train])
  assert 0.02 < rate < 0.09, rate  # about marker_rate
  assert not any(has_planted_property(r["response"]) for r in heldout)
  assert all(has_planted_property(r["reference"]) for r in train + heldout)
  preference.save_records(tmp_path / "heldout.jsonl", heldout)
  loaded, stats = sources.load_records([str(tmp_path / "heldout.jsonl")])
  assert stats.loaded == 40 and loaded[0]["domain"] == "planted"
  assert json.loads((tmp_path / "heldout.jsonl").read_text().splitlines()[0]) == heldout[0]
