"""Reward models as graders of the registry (rl/rewards/manager.py RecordGrader), and the
config.reward.graders spec that names, per data domain, how a response is scored:

  rule        the domain's rule verifier (manager.RULES: math, code, generated puzzles, planted);
  rule_judge  the math verifier, with the GenRM as a Seed-Verifier-style judge only where the
              rules cannot settle (rl/rewards/math.py; genrm.make_math_judge);
  genrm       the pairwise GenRM against the record's reference answer (`reference`, else
              `answer`): the both-orders P(YES) that the response is better than the reference,
              0.5 * (P(YES | response, reference) + 1 - P(YES | reference, response)), in [0, 1]
              as Seed-Thinking-v1.5 uses it;
  bt          the Bradley-Terry RM: sigmoid(r(prompt, response) - r(prompt, reference)), the BT
              probability that the response beats the reference, or sigmoid(r(prompt,
              response)) for a record without one; in [0, 1] too;
  hybrid      (1 - w) * rule + w * RM, the RM config.reward.hybrid_rm names ("genrm" or "bt").

Every score is in [0, 1], the verifiers' scale, so verifier and RM rows meet in one batch
unscaled (DAPO's +-1 mode maps both by 2 s - 1). Each RM grader scores its whole batch in one
call of the RM's jitted, bucketed forward (rl/rewards/genrm.py), never per sample in Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl.rewards import manager
from rl.rewards.genrm import BradleyTerryRM, GenerativeRM, make_math_judge

GRADERS = ("rule", "rule_judge", "genrm", "bt", "hybrid")
HYBRID_RMS = ("genrm", "bt")
# The domains a grader may be named for: every data domain (rl/data/sources.py DOMAINS) and
# "puzzle" (generated puzzles). rule and hybrid need a rule verifier; rule_judge the math one.
DOMAINS = ("math", "code", "logic", "general", "planted", "puzzle")


def parse_graders(text: str) -> dict[str, str]:
  """"general=genrm,math=rule_judge" -> {"general": "genrm", "math": "rule_judge"}: ValueError
  naming config.reward.graders and the bad item."""
  spec: dict[str, str] = {}
  for item in filter(None, (i.strip() for i in text.split(","))):
    domain, sep, grader = (p.strip() for p in item.partition("="))
    problem = None
    if not sep or domain in spec:
      problem = "is not domain=grader (each domain once)"
    elif domain not in DOMAINS:
      problem = f"names domain {domain!r}; domains: {', '.join(DOMAINS)}"
    elif grader not in GRADERS:
      problem = f"names grader {grader!r}; graders: {', '.join(GRADERS)}"
    elif grader in ("rule", "hybrid") and domain not in manager.RULES:
      problem = f"needs a rule verifier, and {domain!r} has none (use genrm or bt)"
    elif grader == "rule_judge" and domain != "math":
      problem = "rule_judge is the math verifier's judge fallback: math only"
    if problem:
      raise ValueError(f"config.reward.graders={text!r}: {item!r} {problem}")
    spec[domain] = grader
  return spec


def rms_needed(spec: Mapping[str, str], hybrid_rm: str) -> set[str]:
  """The reward models ("genrm", "bt") a graders spec reads."""
  needed = set()
  for grader in spec.values():
    if grader in ("genrm", "bt"):
      needed.add(grader)
    elif grader == "rule_judge":
      needed.add("genrm")
    elif grader == "hybrid":
      needed.add(hybrid_rm)
  return needed


def reference_of(entry: Mapping[str, Any]) -> str | None:
  """The reference answer an RM compares a response with: `reference`, else `answer`."""
  reference = entry.get("reference", entry.get("answer"))
  return None if reference is None else str(reference)


class PairwiseGenRM:
  """"genrm": the both-orders P(YES) that the response beats the record's reference."""

  def __init__(self, rm: GenerativeRM):
    self.rm = rm

  def grade(self, entries, responses, *, workers):
    references = []
    for entry in entries:
      reference = reference_of(entry)
      if reference is None:
        raise ValueError("the pairwise GenRM grades against a reference answer; the record has "
                         f"neither 'reference' nor 'answer' ({manager.describe(entry)})")
      references.append(reference)
    return self.rm.score_pairs([manager.question_of(e) for e in entries], list(responses),
                               references).astype(np.float32)

  def vote_key(self, entry, response):
    return None

  def gold_answer(self, entry):
    return reference_of(entry)


class BradleyTerry:
  """"bt": sigmoid of the response's BT reward minus the reference's (or of the reward)."""

  def __init__(self, rm: BradleyTerryRM):
    self.rm = rm

  def grade(self, entries, responses, *, workers):
    prompts = [manager.question_of(e) for e in entries]
    references = [reference_of(e) for e in entries]
    with_reference = [i for i, r in enumerate(references) if r is not None]
    rewards = self.rm.rewards(prompts + [prompts[i] for i in with_reference],
                              list(responses) + [references[i] for i in with_reference])
    margin = rewards[:len(entries)].astype(np.float64)
    margin[with_reference] -= rewards[len(entries):]
    return (1.0 / (1.0 + np.exp(-margin))).astype(np.float32)

  def vote_key(self, entry, response):
    return None

  def gold_answer(self, entry):
    return reference_of(entry)


class Hybrid:
  """"hybrid": (1 - weight) * rule verifier + weight * reward model."""

  def __init__(self, rule: manager.RecordGrader, rm: manager.RecordGrader, weight: float):
    self.rule, self.rm, self.weight = rule, rm, weight

  def grade(self, entries, responses, *, workers):
    rule = self.rule.grade(entries, responses, workers=workers)
    rm = self.rm.grade(entries, responses, workers=workers)
    return ((1.0 - self.weight) * rule + self.weight * rm).astype(np.float32)

  def vote_key(self, entry, response):
    return self.rule.vote_key(entry, response)

  def gold_answer(self, entry):
    return self.rule.gold_answer(entry)


def build_graders(spec: Mapping[str, str], *, genrm: GenerativeRM | None = None,
                  bt: BradleyTerryRM | None = None, hybrid_rm: str = "genrm",
                  hybrid_weight: float = 0.5) -> dict[str, manager.RecordGrader]:
  """The registry of a run: manager.RULES with the domains of `spec` (parse_graders) replaced
  by the graders it names, built on the given reward models."""
  models = {"genrm": PairwiseGenRM(genrm) if genrm is not None else None,
            "bt": BradleyTerry(bt) if bt is not None else None}
  for name in rms_needed(spec, hybrid_rm):
    if models[name] is None:
      raise ValueError(f"config.reward.graders uses the {name} reward model, and none is "
                       f"loaded (config.reward.{name}_dir)")
  graders: dict[str, manager.RecordGrader] = dict(manager.RULES)
  for domain, name in spec.items():
    if name == "rule":
      graders[domain] = manager.RULES[domain]
    elif name == "rule_judge":
      graders[domain] = manager.MathRule(judge=make_math_judge(genrm))
    elif name == "hybrid":
      graders[domain] = Hybrid(manager.RULES[domain], models[hybrid_rm], hybrid_weight)
    else:
      graders[domain] = models[name]
  return graders


def graded_domains(text: str) -> set[str]:
  """The kinds a run's registry grades: the rule verifiers' and those config.reward.graders
  names."""
  return set(manager.RULES) | set(parse_graders(text))


def check_record_domains(entries: Sequence[Mapping[str, Any]], graders_text: str) -> None:
  """Every record's domain has a grader (ValueError naming the first domain without one)."""
  manager.check_graded(entries, graded_domains(graders_text))
