"""Prompt selection rules: pure functions of per-prompt sample outcomes that decide which prompts
an RL (or SFT) run trains on. Each rule's docstring says where it comes from. rl/jobs/select_prompts.py
samples the outcomes from a checkpoint and applies one rule (launch/select_prompts.py).

Inputs are aligned with `records` (entry i belongs to records[i]); a length mismatch or an empty
sample list is a ValueError naming the index, so that a misaligned join fails loudly instead of
silently selecting the wrong prompts.
"""

from __future__ import annotations

import collections
import fractions
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from rl.rewards import math_answer

Record = Mapping[str, Any]


def _check_aligned(records: Sequence[Record], values: Sequence[Any], name: str) -> None:
  if len(records) != len(values):
    raise ValueError(f"{name} has {len(values)} entries for {len(records)} records")


def _check_samples(samples: Sequence[Any], index: int, name: str) -> None:
  if len(samples) == 0:
    raise ValueError(f"{name}[{index}] is empty: every prompt needs at least one sample")


def _scored_samples(records: Sequence[Record], responses: Sequence[Sequence[str]],
                    scores: Sequence[Sequence[float]]):
  """(record, its samples, their scores) for each record, after checking that the three line
  up and that every prompt has samples."""
  _check_aligned(records, responses, "responses")
  _check_aligned(records, scores, "scores")
  for i, (record, samples, sample_scores) in enumerate(zip(records, responses, scores)):
    _check_samples(samples, i, "responses")
    if len(sample_scores) != len(samples):
      raise ValueError(f"scores[{i}] has {len(sample_scores)} entries for {len(samples)} "
                       "responses")
    yield record, samples, sample_scores


# ----------------------------------------------------------------------------- Rejection sampling

def keep_verified(records: Sequence[Record], responses: Sequence[Sequence[str]],
                  scores: Sequence[Sequence[float]], *, min_score: float = 1.0) -> list[Record]:
  """The verified responses as SFT records: each record with one kept "response" added.

  Rejection-sampling fine-tuning (Yuan et al., 2023, "Scaling relationship on learning
  mathematical reasoning"); the cold-start and SFT data of Seed-Thinking-v1.5 and
  DeepSeek-R1 are built this way. `responses[i]` are records[i]'s sampled responses and
  `scores[i]` their grades (e.g. rl/rewards/manager.py::score_responses); a response is kept
  when its score is >= `min_score` (1.0: a correct answer under the 0/1 rewards). Identical
  correct responses to one prompt are kept once. The records keep their grader fields, so the
  result is again a prompt-record file's rows, which the trainer and SFT read.
  """
  kept = []
  for record, samples, sample_scores in _scored_samples(records, responses, scores):
    verified = dict.fromkeys(r for r, score in zip(samples, sample_scores) if score >= min_score)
    kept.extend({**record, "response": response} for response in verified)
  logging.info("rejection sampling: kept %d of %d responses", len(kept),
               sum(len(samples) for samples in responses))
  return kept


# ----------------------------------------------------------------------------- Difficulty filters

def worst_of_n_filter(records: Sequence[Record],
                      accuracies: Sequence[Sequence[float]]) -> list[Record]:
  """Drops prompts the model solves in every one of its n samples; keeps the rest, in order.

  Seed-Thinking-v1.5 (§2.1, RL data cleaning): prompts the current model always answers
  correctly give no learning signal (every GRPO advantage is zero) and are removed, so that a
  prompt survives only if the worst of its n samples is wrong. `accuracies[i]` holds records[i]'s
  sample outcomes, each 0 or 1.
  """
  _check_aligned(records, accuracies, "accuracies")
  kept = []
  for i, (record, outcomes) in enumerate(zip(records, accuracies)):
    _check_samples(outcomes, i, "accuracies")
    if any(outcome not in (0, 1) for outcome in outcomes):
      raise ValueError(f"accuracies[{i}] must hold 0/1 outcomes, got {list(outcomes)}")
    if not all(outcomes):
      kept.append(record)
  logging.info("worst-of-n filter: kept %d of %d prompts", len(kept), len(records))
  return kept


def low_variance_removal(records: Sequence[Record], rewards: Sequence[Sequence[float]], *,
                         min_std: float = 1e-6) -> list[Record]:
  """Drops prompts whose sampled rewards have std <= `min_std`; keeps the rest, in order.

  The offline form of DAPO's dynamic sampling (Yu et al., 2025): a group whose rewards do not vary
  has zero group-normalised advantage, so it costs rollout compute and teaches nothing.
  `rewards[i]` holds the rewards of records[i]'s samples (population std, ddof=0).
  """
  _check_aligned(records, rewards, "rewards")
  kept = []
  for i, (record, sampled) in enumerate(zip(records, rewards)):
    _check_samples(sampled, i, "rewards")
    if float(np.std(np.asarray(sampled, dtype=np.float64))) > min_std:
      kept.append(record)
  logging.info("low-variance removal: kept %d of %d prompts", len(kept), len(records))
  return kept


# ----------------------------------------------------------------------------- Reference audit

_DECIMAL = re.compile(r"-?\d+(?:\.\d+)?")


def answer_key(answer: str) -> str:
  """A comparison key: the math reward's normalisation, whitespace dropped, words caseless,
  and decimal numbers as exact fractions (so "2", "2.0" and "02" agree)."""
  key = re.sub(r"\s+", "", math_answer.normalize_answer(answer))
  if _DECIMAL.fullmatch(key) and len(key) <= 100:
    return str(fractions.Fraction(key))
  return key.lower() if key.isalpha() else key


def reference_audit(records: Sequence[Record], sampled_answers: Sequence[Sequence[str | None]],
                    *, threshold: float = 0.8,
                    normalize: Callable[[str], str] = answer_key) -> list[int]:
  """Indices of prompts whose reference answer is probably wrong, for a human to check.

  Seed-Thinking-v1.5 (§2.1, data cleaning): where the model's samples agree with each other but
  not with the reference, the reference is more often at fault than the model. Flags records[i]
  when the most common normalised answer among `sampled_answers[i]` takes a share >= `threshold`
  of all samples (None, an unparsed answer, counts as a sample but never as the majority) and
  differs from the normalised `answer` field. Records without an answer are not flagged.
  """
  _check_aligned(records, sampled_answers, "sampled_answers")
  if not 0.0 < threshold <= 1.0:
    raise ValueError(f"threshold must be in (0, 1], got {threshold}")
  flagged = []
  for i, (record, answers) in enumerate(zip(records, sampled_answers)):
    _check_samples(answers, i, "sampled_answers")
    reference = record.get("answer")
    counts = collections.Counter(normalize(a) for a in answers if a is not None)
    if reference is None or not counts:
      continue
    majority, votes = counts.most_common(1)[0]
    if votes / len(answers) >= threshold and majority != normalize(reference):
      flagged.append(i)
  logging.info("reference audit: flagged %d of %d prompts", len(flagged), len(records))
  return flagged



# ----------------------------------------------------------------------------- Pre-PPO

def domain_z_scores(records: Sequence[Record], scores: Sequence[float]) -> np.ndarray:
  """Each score z-normalised within its record's domain ("domain" field; records without one
  form one group): (s - mean) / std over that domain's prompts (population std; 0 for every
  prompt of a domain whose scores are all equal)."""
  _check_aligned(records, scores, "scores")
  scores = np.asarray(scores, np.float64)
  domains = np.array([str(r.get("domain", "")) for r in records])
  z = np.zeros(len(scores))
  for domain in np.unique(domains):
    members = domains == domain
    std = scores[members].std()
    z[members] = (scores[members] - scores[members].mean()) / std if std > 0 else 0.0
  return z


def pre_ppo_select(records: Sequence[Record], scores: Sequence[float], *,
                   fraction: float = 0.1) -> list[int]:
  """Indices (ascending) of the prompts Pre-PPO keeps: the ceil(fraction * N) lowest
  reward-model scores after `domain_z_scores`, ties broken by position.

  The RLHF data-scaling study's Pre-PPO: prompts the reward model scores lowest are the ones
  the policy has most left to learn on (and the hardest to hack); normalising within each
  domain first keeps one domain's score scale from filling the selection.
  """
  if not 0.0 < fraction <= 1.0:
    raise ValueError(f"fraction must be in (0, 1], got {fraction}")
  z = domain_z_scores(records, scores)
  count = int(np.ceil(fraction * len(records) - 1e-9))
  kept = sorted(np.argsort(z, kind="stable")[:count].tolist())
  logging.info("Pre-PPO: kept the %d lowest of %d prompts (fraction %.3f)", len(kept),
               len(records), fraction)
  return kept


def pre_ppo_merge(records: Sequence[Record], kept: Sequence[int]) -> list[Record]:
  """The original set followed by one more copy of each kept prompt (marked "pre_ppo": True),
  so an epoch over the written file draws the selected prompts twice as often as the rest."""
  return [*records, *({**records[i], "pre_ppo": True} for i in kept)]


# ----------------------------------------------------------------------------- Best-of-N reference

def best_of_n_reference(records: Sequence[Record], responses: Sequence[Sequence[str]],
                        scores: Sequence[Sequence[float]]) -> list[Record]:
  """Each record with its best-scored sample as "reference" (the first of equal scores) and
  that sample's score as "reference_score".

  The RLHF data-scaling study's reference for general prompts: N responses sampled per prompt,
  the one a Bradley-Terry RM scores highest kept, for a pairwise GenRM to judge the policy's
  responses against in RL (config.reward.graders "general=genrm" reads `reference`). `scores`
  should be monotone in the RM's reward: the "bt" grader's sigmoid(r), or sigmoid(r - r_ref)
  where a record already has a reference (which is then replaced).
  """
  out = []
  for record, samples, sample_scores in _scored_samples(records, responses, scores):
    best = int(np.argmax(np.asarray(sample_scores, np.float64)))
    out.append({**record, "reference": samples[best],
                "reference_score": float(sample_scores[best])})
  return out
