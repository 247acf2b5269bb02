"""The planted property of the planted-preference task (rl/jobs/preference.py
make_planted_preferences) as a rule grader: a response has it when its last word is the marker
"thanks". Records of domain "planted" are general prompts graded by this rule (manager.RULES),
so a run whose training prompts are scored only by a reward model can report, on held-out
prompts of that domain, the rate at which the policy's responses show the property the reward
model was trained to prefer."""

from __future__ import annotations

import numpy as np

PLANTED_MARKER = "thanks"


def _last_word(response: str) -> str | None:
  words = response.split()
  return words[-1].strip(".!,").lower() if words else None


def has_planted_property(response: str) -> bool:
  """The planted preference's checkable property: the response's last word is the marker."""
  return _last_word(response) == PLANTED_MARKER


class PlantedRule:
  """1.0 where the response has the planted property, else 0.0; the vote key is the last word."""

  def grade(self, entries, responses, *, workers):
    return np.array([float(has_planted_property(r)) for r in responses], np.float32)

  def vote_key(self, entry, response):
    return _last_word(response)

  def gold_answer(self, entry):
    return PLANTED_MARKER
