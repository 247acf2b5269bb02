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


def test_reward_model_scores_inside_a_trainer_mesh():
  """The RM runs on the device it was loaded on, also inside the ambient mesh over all devices
  that the trainer grades under (Placement.scope): that raised 'incompatible devices'."""
  import jax
  from flax import nnx

  from models.tokenizer import ByteTokenizer
  from models.transformer import build
  from rl.rewards import genrm

  # Committed to one device, as a loaded checkpoint's parameters are.
  graphdef, params, rest = nnx.split(build("tiny_dense", seed=3, head="scalar"), nnx.Param, ...)
  params = jax.device_put(params, jax.devices()[0])
  rm = genrm.BradleyTerryRM((graphdef, params, rest), ByteTokenizer())
  prompts, responses = ["Describe a storm."] * 2, ["A storm: calm, thanks", "A storm: calm, indeed"]
  alone = rm.rewards(prompts, responses)
  assert len(jax.devices()) > 1
  with jax.set_mesh(jax.make_mesh((len(jax.devices()),), ("data",))):
    np.testing.assert_allclose(rm.rewards(prompts, responses), alone, rtol=1e-6)


def test_mixed_records_grade_additions_by_the_verifier_and_planted_prompts_by_their_domain():
  """make_mixed_records: additions (puzzle records: the verifier grades them) beside planted
  general prompts; training additions carry the teacher's slips (some worked solutions give a
  wrong sum), held-out ones none, and no held-out planted response shows the marker."""
  train = preference.make_mixed_records(400, 100, 0)
  heldout = preference.make_mixed_records(100, 20, 1, heldout=True)
  assert train == preference.make_mixed_records(400, 100, 0)
  kinds = [manager.kind_of(r) for r in train]
  assert kinds.count("puzzle") == 400 and kinds.count("general") == 100
  assert kinds != sorted(kinds)  # shuffled, not blocks
  additions = [r for r in train if manager.kind_of(r) == "puzzle"]
  solved = manager.score_responses(additions, [r["solution"] for r in additions])
  assert 0.3 < solved.mean() < 0.95, solved.mean()  # the slips: carry sums demonstrated wrong
  held_additions = [r for r in heldout if manager.kind_of(r) == "puzzle"]
  assert manager.score_responses(held_additions, [r["solution"] for r in held_additions]).all()
  assert {r["domain"] for r in heldout if manager.kind_of(r) != "puzzle"} == {"planted"}
