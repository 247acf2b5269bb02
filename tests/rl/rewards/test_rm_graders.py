"""The grading registry with reward models: the graders config.reward.graders names per domain
score what the seeds say (pairwise P(YES) against the reference, a BT probability, a weighted
hybrid, a judge only where the rules cannot settle), in [0, 1]; a domain without a grader and a
bad spec fail naming the field; DeepSeek-V3.2's shaping terms are what they claim."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from models.tokenizer import ByteTokenizer
from models.transformer import build
from rl.rewards import genrm, manager, rm_graders
from rl.rewards.shaping import language_consistency, length_penalty

TOKENIZER = ByteTokenizer()
GENERAL = {"prompt": "Describe a cat.", "domain": "general", "reference": "A small furry pet."}


@functools.cache
def judge():
  return genrm.GenerativeRM(build("tiny_dense", seed=3), TOKENIZER, batch_size=8)


@functools.cache
def bt_model():
  return genrm.BradleyTerryRM(build("tiny_dense", seed=4, head="scalar"), TOKENIZER,
                              batch_size=8)


def test_genrm_grader_is_the_both_orders_p_yes_against_the_reference():
  """A general record is scored by the GenRM against its reference: exactly score_pairs(prompt,
  response, reference), in [0, 1], and 0.5 for a response equal to the reference."""
  graders = rm_graders.build_graders({"general": "genrm"}, genrm=judge())
  responses = ["A cat is a pet.", "Dogs bark.", GENERAL["reference"]]
  scores = manager.score_responses([GENERAL] * 3, responses, graders=graders)
  expected = judge().score_pairs([GENERAL["prompt"]] * 3, responses, [GENERAL["reference"]] * 3)
  np.testing.assert_allclose(scores, expected, atol=1e-6)
  assert np.all((scores >= 0) & (scores <= 1)) and scores[2] == 0.5
  assert manager.gold_answer(GENERAL, graders) == GENERAL["reference"]


def test_bt_grader_is_the_probability_of_beating_the_reference():
  """BT score = sigmoid(r(prompt, response) - r(prompt, reference)), or sigmoid(r) without a
  reference (computed here from the RM's own rewards)."""
  graders = rm_graders.build_graders({"general": "bt"}, bt=bt_model())
  bare = {"prompt": "Say hi.", "domain": "general"}
  scores = manager.score_responses([GENERAL, bare], ["Cats purr.", "hi"], graders=graders)
  r = bt_model().rewards([GENERAL["prompt"], GENERAL["prompt"], "Say hi."],
                         ["Cats purr.", GENERAL["reference"], "hi"]).astype(np.float64)
  sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
  np.testing.assert_allclose(scores, [sigmoid(r[0] - r[1]), sigmoid(r[2])], atol=1e-6)


class FixedRM:
  """A stand-in RM grader with known scores, to check the hybrid's arithmetic."""

  def __init__(self, value):
    self.value = value

  def grade(self, entries, responses, *, workers):
    return np.full(len(entries), self.value, np.float32)


def test_hybrid_is_the_weighted_mix_of_rule_and_rm():
  """hybrid = (1 - w) * rule + w * RM: a right math answer with RM 0.2 at w = 0.25 scores
  0.75 * 1 + 0.25 * 0.2 = 0.8, a wrong one 0.05."""
  hybrid = rm_graders.Hybrid(manager.RULES["math"], FixedRM(0.2), 0.25)
  record = {"prompt": "What is 2 + 2?", "answer": "4", "domain": "math"}
  scores = manager.score_responses([record, record], ["\\boxed{4}", "\\boxed{5}"],
                                   graders={"math": hybrid})
  np.testing.assert_allclose(scores, [0.8, 0.05], atol=1e-6)


def test_judge_fallback_runs_only_where_rules_cannot_settle():
  """rule_judge: answers the rules settle never reach the GenRM; the unparsable one does, in a
  single batched call, and its score is the judge's P(YES) of the equivalence prompt."""
  rm = judge()
  calls = []
  real = rm.p_yes

  def counted(prompts):
    calls.append(list(prompts))
    return real(prompts)

  rm.p_yes = counted
  try:
    graders = rm_graders.build_graders({"math": "rule_judge"}, genrm=rm)
    record = {"prompt": "What is one half?", "answer": "\\frac{1}{2}", "domain": "math"}
    scores = manager.score_responses([record] * 3, ["\\boxed{\\frac{1}{2}}", "Answer: \\frac{1}{2",
                                                    "\\boxed{3}"], graders=graders)
  finally:
    rm.p_yes = real
  assert len(calls) == 1 and len(calls[0]) == 1
  expected = real([genrm.equivalence_prompt("What is one half?", "\\frac{1}{2}", "\\frac{1}{2")])
  np.testing.assert_allclose(scores, [1.0, expected[0], 0.0], atol=1e-6)


def test_a_domain_without_a_grader_fails_naming_it():
  """General records are refused unless a grader is configured for them."""
  with pytest.raises(ValueError, match="no grader for domain 'general'"):
    rm_graders.check_record_domains([GENERAL], "")
  rm_graders.check_record_domains([GENERAL], "general=genrm")
  with pytest.raises(ValueError, match="no grader for domain 'general'"):
    manager.score_responses([GENERAL], ["x"])


@pytest.mark.parametrize("spec,message", [
    ("general=rule", "has none"), ("code=rule_judge", "math only"), ("math=genrm,math=bt", "once"),
    ("poetry=genrm", "domain 'poetry'"), ("math=oracle", "grader 'oracle'"),
])
def test_bad_graders_spec_names_the_field(spec, message):
  with pytest.raises(ValueError, match=f"config.reward.graders=.*{message}"):
    rm_graders.parse_graders(spec)


def test_a_missing_reward_model_is_refused():
  with pytest.raises(ValueError, match="genrm reward model"):
    rm_graders.build_graders({"general": "genrm"})


def test_length_penalty_is_linear_in_the_budget_share():
  np.testing.assert_allclose(length_penalty(jnp.array([0, 4, 16]), max_len=16, coef=0.5),
                             [0.0, -0.125, -0.5])


def test_language_consistency_is_the_share_of_letters_in_the_prompt_script():
  """Cyrillic prompt; "hello мир": 3 of 8 letters Cyrillic (digits, spaces not counted)."""
  assert language_consistency("Привет, как дела?", "hello мир 42") == pytest.approx(3 / 8)
  assert language_consistency("What is 2 + 2?", "Answer: 4") == 1.0
  assert language_consistency("What is 2 + 2?", "答案 4") == 0.0
  assert language_consistency("2 + 2", "четыре") == 1.0  # no letters in the prompt
