"""Prompt selection rules (rl/data/selection.py) on data whose right answer is known."""

import pytest

from rl.data import selection


def record(i, domain="math", answer=None):
  row = {"prompt": f"q{i}", "data_source": "unit", "domain": domain}
  if answer is not None:
    row["answer"] = answer
  return row


# ----------------------------------------------------------------------------- Rejection sampling

def fake_generate(prompts, n):
  """Response k to prompt "qi" is "qi:k"; the verifier below accepts even k for even i only."""
  return [[f"{p['prompt']}:{k % 3}" for k in range(n)] for p in prompts]


def even_verifier(entries, responses):
  """Batched, like the reward manager: one score per (entry, response)."""
  scores = []
  for entry, response in zip(entries, responses):
    i, k = int(entry["prompt"][1:]), int(response.split(":")[1])
    scores.append(1.0 if i % 2 == 0 and k % 2 == 0 else 0.0)
  return scores


def test_keep_verified_keeps_verified_unique_responses():
  """Only verified responses are kept, each distinct one once, with the prompt's fields."""
  prompts = [record(i, answer=str(i)) for i in range(4)]
  responses = fake_generate(prompts, 4)
  scores = [even_verifier([p] * 4, samples) for p, samples in zip(prompts, responses)]
  kept = selection.keep_verified(prompts, responses, scores)
  # n=4 gives k%3 = 0,1,2,0: correct responses "qi:0" (twice) and "qi:2" for even i.
  assert [(r["prompt"], r["response"]) for r in kept] == [
      ("q0", "q0:0"), ("q0", "q0:2"), ("q2", "q2:0"), ("q2", "q2:2")]
  assert kept[0] == {"prompt": "q0", "response": "q0:0", "data_source": "unit", "domain": "math",
                     "answer": "0"}
  with pytest.raises(ValueError, match=r"scores\[1\] has 3 entries for 4 responses"):
    selection.keep_verified(prompts, responses, [scores[0], scores[1][:3], *scores[2:]])


# ----------------------------------------------------------------------------- Filters

def test_worst_of_n_drops_only_always_solved():
  """Prompts solved in every sample are dropped; any failure keeps the prompt."""
  records = [record(i) for i in range(4)]
  kept = selection.worst_of_n_filter(records, [[1, 1, 1], [1, 0, 1], [0, 0, 0], [True, True]])
  assert kept == [records[1], records[2]]
  with pytest.raises(ValueError, match="0/1 outcomes"):
    selection.worst_of_n_filter(records[:1], [[0.5, 1]])
  with pytest.raises(ValueError, match=r"accuracies\[0\] is empty"):
    selection.worst_of_n_filter(records[:1], [[]])
  with pytest.raises(ValueError, match="3 entries for 4 records"):
    selection.worst_of_n_filter(records, [[0]] * 3)


def test_low_variance_removal():
  """Groups with constant rewards are dropped; groups that vary are kept."""
  records = [record(i) for i in range(4)]
  rewards = [[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [-1.0, -1.0], [0.1, 0.1 + 1e-3]]
  assert selection.low_variance_removal(records, rewards) == [records[1], records[3]]
  # std of the last group is 5e-4: a larger min_std removes it too.
  assert selection.low_variance_removal(records, rewards, min_std=1e-3) == [records[1]]


# ----------------------------------------------------------------------------- Reference audit

def test_reference_audit_flags_confident_disagreement():
  """Flags only prompts whose consistent majority contradicts the reference."""
  records = [record(0, answer="5"), record(1, answer="2"), record(2, answer="7"),
             record(3, answer="1/2"), record(4), record(5, answer="3")]
  sampled = [
      ["6", "6", "6", "6", "5"],  # 80% agree on 6, reference 5: flagged
      ["2.0", " 2", "$2$", "02", "3"],  # 80% agree with the reference after normalising
      ["1", "2", "3", "4", "1"],  # no consensus
      ["\\frac{1}{3}", "\\frac{1}{3}", "\\frac13", None, "x"],  # 60% < 80%
      ["9", "9", "9"],  # no reference answer
      ["4", "4", "4", None, None],  # unparsed samples count against the share
  ]
  assert selection.reference_audit(records, sampled) == [0]
  assert selection.reference_audit(records, sampled, threshold=0.6) == [0, 3, 5]


def test_answer_key_equates_forms_of_one_answer():
  """Numbers compare by value, words caselessly, LaTeX after the math normalisation."""
  assert selection.answer_key("2.50") == selection.answer_key("2.5")
  assert selection.answer_key("1,000") == selection.answer_key("1000")
  assert selection.answer_key("Yes") == selection.answer_key("yes")
  assert selection.answer_key("\\dfrac{1}{2}") == selection.answer_key("\\frac{1}{2}")
  assert selection.answer_key("2") != selection.answer_key("3")
