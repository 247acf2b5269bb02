"""Preference-learning tests: jsonl loading, the judge and reward-model APIs, and short training
runs on the synthetic set (Bradley-Terry RM, generative judge, a judge with planted position
bias, DPO) that must lift held-out pairwise accuracy well above chance on tiny_dense."""

import functools
import json
import re

import numpy as np
import pytest

from models.tokenizer import ByteTokenizer
from models.transformer import build
from rl.jobs import preference
from rl.jobs.preference import JudgeExample, PreferencePair
from rl.rewards import genrm

TOKENIZER = ByteTokenizer()


@functools.lru_cache(maxsize=None)
def synthetic(n, seed):
  return tuple(preference.make_synthetic_preferences(n, seed))


def train_set():
  return synthetic(256, 0)


def heldout_set():
  return synthetic(64, 1)


# ----------------------------------------------------------------------------- Data


def test_synthetic_pairs_follow_the_rule_and_heldout_is_disjoint():
  """Every chosen response follows the checkable rule, every rejected one breaks it, and the
  held-out seed shares no chosen response with the training seed."""
  for pair in train_set() + heldout_set():
    assert preference.follows_synthetic_rule(pair.chosen)
    assert not preference.follows_synthetic_rule(pair.rejected)
  assert not {p.chosen for p in train_set()} & {p.chosen for p in heldout_set()}


def test_jsonl_round_trip_and_malformed_lines(tmp_path):
  """Saved pairs load back equal; a malformed line raises ValueError naming file:line, and with
  skip_bad=True each malformed line is skipped and counted while good lines still load."""
  pairs = [PreferencePair("q1", "good", "bad"), PreferencePair("q2", "yes", "no", reference="4")]
  path = tmp_path / "prefs.jsonl"
  preference.save_preferences(path, pairs)
  assert preference.load_preferences(path) == (pairs, 0)

  bad = tmp_path / "bad.jsonl"
  lines = [json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}),
           "",
           '{"prompt": "q", "chosen": "a"',  # truncated JSON
           json.dumps({"prompt": "q", "chosen": "a"}),  # no "rejected"
           json.dumps(["q", "a", "b"]),  # not an object
           json.dumps({"prompt": "q", "chosen": "a", "rejected": "b", "reference": 3}),
           json.dumps({"prompt": "q2", "chosen": "c", "rejected": "d", "id": 7})]
  bad.write_text("\n".join(lines) + "\n")
  with pytest.raises(ValueError, match=re.escape(f"{bad}:3: not valid JSON")):
    preference.load_preferences(bad)
  loaded, skipped = preference.load_preferences(bad, skip_bad=True)
  assert skipped == 4
  assert loaded == [PreferencePair("q", "a", "b"), PreferencePair("q2", "c", "d")]

  missing_key = tmp_path / "missing.jsonl"
  missing_key.write_text(lines[0] + "\n" + lines[3] + "\n")
  with pytest.raises(ValueError, match=re.escape(f"{missing_key}:2: field 'rejected'")):
    preference.load_preferences(missing_key)


# ----------------------------------------------------------------------------- Judge / RM APIs


def test_judge_prompt_and_answer_tokens():
  """The judge prompt holds both responses (and the reference when given) in order and ends
  with the YES/NO question; the byte tokenizer's answer ids are the bytes "Y" and "N"."""
  prompt = genrm.judge_prompt("What is 2+2?", "four", "five", reference="4")
  assert prompt.index("four") < prompt.index("five")
  assert "[Reference answer]\n4" in prompt
  assert prompt.endswith("Is Response A better than Response B? Answer YES or NO.\n")
  assert "[Reference answer]" not in genrm.judge_prompt("q", "a", "b")
  assert genrm.answer_token_ids(TOKENIZER) == (TOKENIZER.token_to_id("Y"),
                                               TOKENIZER.token_to_id("N"))


def test_untrained_judge_scores_are_consistent_across_batching():
  """On any judge: p_yes is a probability and does not depend on batching or padding; the
  both-orders score is exactly 0.5 for identical responses and score(a, b) = 1 - score(b, a);
  the math judge returns P(YES) of the equivalence prompt."""
  rm = genrm.GenerativeRM(build("tiny_dense", seed=3), TOKENIZER, batch_size=4)
  prompts = [genrm.judge_prompt(p.prompt, p.chosen, p.rejected) for p in heldout_set()[:6]]
  batched = rm.p_yes(prompts)
  one_by_one = np.concatenate([rm.p_yes([p]) for p in prompts])
  assert np.all((batched > 0) & (batched < 1))
  np.testing.assert_allclose(batched, one_by_one, atol=1e-6)
  assert rm.score_pair("q", "same", "same") == 0.5
  forward = rm.score_pair("q", "abc", "XYZ")
  assert forward == pytest.approx(1 - rm.score_pair("q", "XYZ", "abc"), abs=1e-12)
  judge = genrm.make_math_judge(rm)
  expected = rm.p_yes([genrm.equivalence_prompt("1+1?", "2", "two")])[0]
  assert judge(["1+1?"], ["2"], ["two"])[0] == pytest.approx(float(expected))
  with pytest.raises(ValueError, match="head='scalar'"):
    genrm.BradleyTerryRM(build("tiny_dense", seed=3), TOKENIZER)


def test_bt_reward_is_the_value_at_the_last_real_token():
  """BradleyTerryRM.rewards equals the scalar head's value at the last prompt+response token,
  whatever the padding of the batch it is computed in."""
  model = build("tiny_dense", seed=4, head="scalar")
  rm = genrm.BradleyTerryRM(model, TOKENIZER)
  prompts, responses = ["Name a city.", "Name a fruit please."], ["paris", "KIWI!"]
  rewards = rm.rewards(prompts, responses)
  for prompt, response, reward in zip(prompts, responses, rewards):
    ids = np.array([TOKENIZER.encode(prompt + response)], np.int32)
    assert reward == pytest.approx(float(model(ids)[0, -1]), abs=1e-5)


# ----------------------------------------------------------------------------- Training


def test_bt_training_lifts_heldout_accuracy():
  """Bradley-Terry training (bt_loss) on the synthetic set takes held-out pairwise accuracy
  r(chosen) > r(rejected) from near chance to >= 0.9."""
  rm, metrics = preference.train_bt_rm(build("tiny_dense", seed=0, head="scalar"), TOKENIZER,
                                       train_set(), heldout_set(), steps=80, batch_size=16)
  print("bt", metrics)
  assert metrics["heldout_accuracy"] >= 0.9
  assert metrics["heldout_accuracy"] > metrics["heldout_accuracy_start"] + 0.2
  assert metrics["train_loss_end"] < metrics["train_loss_start"]
  assert preference.bt_accuracy(rm, heldout_set()) == metrics["heldout_accuracy"]


def test_generative_rm_training_lifts_heldout_accuracy():
  """Training the judge on both orders of each pair (YES when A is chosen) makes the
  both-orders score_pair(chosen, rejected) > 0.5 on >= 0.85 of held-out pairs, up from near
  chance, and the single-order judgement is also right well above chance."""
  rm, metrics = preference.train_generative_rm(build("tiny_dense", seed=0), TOKENIZER,
                                               train_set(), heldout_set(), steps=100,
                                               batch_size=16, lr=2e-3)
  print("genrm", metrics)
  assert metrics["heldout_accuracy"] >= 0.85
  assert metrics["heldout_accuracy"] > metrics["heldout_accuracy_start"] + 0.2
  assert metrics["heldout_accuracy_single_order"] >= 0.75
  pair = heldout_set()[0]
  assert rm.score_pair(pair.prompt, pair.chosen, pair.rejected) > 0.5


def test_both_orders_cancel_a_planted_position_bias():
  """A judge trained with labels biased toward YES (most rejected-first prompts relabelled
  YES) answers P(YES | x, x) far from 0.5 for identical responses, yet its both-orders score
  of identical pairs is exactly 0.5 and its both-orders held-out accuracy is at least the
  single-order accuracy."""
  rng = np.random.default_rng(0)
  biased = [JudgeExample(e.prompt, e.yes or rng.random() < 0.75)
            for e in preference.judge_examples(train_set())]
  rm, metrics = preference.train_judge(build("tiny_dense", seed=0), TOKENIZER, biased,
                                       heldout_set(), steps=100, batch_size=16, lr=2e-3)
  print("biased", metrics)
  pairs = heldout_set()[:16]
  identical = [genrm.judge_prompt(p.prompt, r, r) for p in pairs for r in (p.chosen, p.rejected)]
  p_same = rm.p_yes(identical)
  assert np.min(np.abs(p_same - 0.5)) > 0.1, p_same
  scores = rm.score_pairs([p.prompt for p in pairs for _ in range(2)],
                          [r for p in pairs for r in (p.chosen, p.rejected)],
                          [r for p in pairs for r in (p.chosen, p.rejected)])
  assert np.all(scores == 0.5)
  assert metrics["heldout_accuracy"] >= metrics["heldout_accuracy_single_order"]
  assert metrics["heldout_accuracy"] >= 0.8


def test_dpo_lowers_loss_and_makes_heldout_margin_positive():
  """DPO against a frozen copy of the initial policy: the training loss falls from log 2, the
  held-out DPO loss falls, and the held-out implicit reward margin, exactly 0 at the start,
  becomes positive with most held-out pairs ranked correctly."""
  policy = build("tiny_dense", seed=0)
  before = np.asarray(policy(np.ones((1, 4), np.int32)))
  trained, metrics = preference.train_dpo(policy, TOKENIZER, train_set(), heldout_set(),
                                          beta=0.1, steps=40, batch_size=16)
  print("dpo", metrics)
  assert metrics["train_loss_start"] == pytest.approx(np.log(2), abs=1e-5)
  assert metrics["heldout_reward_margin_start"] == 0.0
  assert metrics["train_loss_end"] < metrics["train_loss_start"] - 0.1
  assert metrics["heldout_loss"] < metrics["heldout_loss_start"]
  assert metrics["heldout_reward_margin"] > 0.1
  assert metrics["heldout_accuracy"] >= 0.9
  np.testing.assert_array_equal(np.asarray(policy(np.ones((1, 4), np.int32))), before)
  assert not np.allclose(np.asarray(trained(np.ones((1, 4), np.int32))), before)
