"""Prompt selection rules: pure functions of per-prompt sample outcomes that decide which prompts
an RL (or SFT) run trains on. Each rule's docstring says where it comes from.

Inputs are aligned with `records` (entry i belongs to records[i]); a length mismatch or an empty
sample list is a ValueError naming the index, so that a misaligned join fails loudly instead of
silently selecting the wrong prompts.
"""

from __future__ import annotations

import collections
import fractions
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from absl import logging

from rl.rewards import math as math_reward

Record = Mapping[str, Any]


def _check_aligned(records: Sequence[Record], values: Sequence[Any], name: str) -> None:
  if len(records) != len(values):
    raise ValueError(f"{name} has {len(values)} entries for {len(records)} records")


def _check_samples(samples: Sequence[Any], index: int, name: str) -> None:
  if len(samples) == 0:
    raise ValueError(f"{name}[{index}] is empty: every prompt needs at least one sample")


# ----------------------------------------------------------------------------- Rejection sampling

def rejection_sample(prompts: Sequence[Record],
                     generate_fn: Callable[[Sequence[Record], int], Sequence[Sequence[str]]],
                     verify_fn: Callable[[Sequence[Record], Sequence[str]], Sequence[float]],
                     *, n: int, out_path: str,
                     min_score: float = 1.0, batch_size: int | None = None) -> dict[str, int]:
  """Samples `n` responses per prompt, keeps the verified ones and writes them as SFT jsonl.

  Rejection-sampling fine-tuning (Yuan et al., 2023, "Scaling relationship on learning
  mathematical reasoning"); the cold-start and SFT data of Seed-Thinking-v1.5 and
  DeepSeek-R1 are built this way. `generate_fn(prompts, n)` returns n response strings per
  prompt; `verify_fn(records, responses)` grades aligned lists in one call (one batch of the
  verifier, e.g. rl/rewards/manager.py::score_responses) and a response is kept when its score
  is >= `min_score` (1.0: a correct answer under the 0/1 rewards). Identical correct responses
  to one prompt are written once. Each line is the record with the kept "response" added (so
  the file is again a prompt-record file the trainer and SFT read, its grader fields kept).
  `batch_size` prompts go to `generate_fn` at a time (default: all). The file appears complete
  or not at all (written beside, then renamed).

  Returns {"kept", "total" (responses sampled), "prompts", "prompts_with_correct"}.
  """
  if n <= 0:
    raise ValueError(f"n must be positive, got {n}")
  batch_size = batch_size or max(len(prompts), 1)
  stats = {"kept": 0, "total": 0, "prompts": len(prompts), "prompts_with_correct": 0}
  temporary_path = out_path + ".tmp"
  with open(temporary_path, "w", encoding="utf-8") as f:
    for start in range(0, len(prompts), batch_size):
      batch = prompts[start:start + batch_size]
      responses = generate_fn(batch, n)
      _check_aligned(batch, responses, "generate_fn output")
      for offset, samples in enumerate(responses):
        if len(samples) != n:
          raise ValueError(f"generate_fn gave {len(samples)} responses for prompt "
                           f"{start + offset}, expected {n}")
      flat_records = [record for record in batch for _ in range(n)]
      flat_responses = [r for samples in responses for r in samples]
      scores = np.asarray(verify_fn(flat_records, flat_responses), np.float64)
      if scores.shape != (len(flat_responses),):
        raise ValueError(f"verify_fn gave {scores.shape} scores for {len(flat_responses)} "
                         "responses")
      for offset, (record, samples) in enumerate(zip(batch, responses)):
        stats["total"] += n
        row_scores = scores[offset * n:(offset + 1) * n]
        kept = dict.fromkeys(r for r, score in zip(samples, row_scores) if score >= min_score)
        stats["kept"] += len(kept)
        stats["prompts_with_correct"] += bool(kept)
        for response in kept:
          f.write(json.dumps({**record, "response": response}, ensure_ascii=False) + "\n")
  os.replace(temporary_path, out_path)
  logging.info("rejection sampling: kept %d of %d responses; %d of %d prompts solved -> %s",
               stats["kept"], stats["total"], stats["prompts_with_correct"], stats["prompts"],
               out_path)
  return stats


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


def pre_ppo_select(records: Sequence[Record], rm_scores: Sequence[float], *,
                   keep_fraction: float = 0.1) -> list[Record]:
  """Keeps the `keep_fraction` of prompts with the lowest domain-normalised reward-model score.

  Pre-PPO prompt selection from the RLHF data-scaling study (Shen et al., 2025, "Exploring data
  scaling trends and effects in RLHF"): prompts on which the SFT policy's responses score low
  under the reward model are the challenging ones worth PPO's compute; the paper keeps the
  bottom 10%. Reward scales differ between task domains, so scores are z-scored within each
  record's `domain` first (a domain with one prompt or constant scores gets 0). Keeps
  round(keep_fraction * len(records)) prompts, at least one; ties go to the earlier record.
  Returns the kept records in their original order.
  """
  _check_aligned(records, rm_scores, "rm_scores")
  if not 0.0 < keep_fraction <= 1.0:
    raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
  if not records:
    return []
  scores = np.asarray(rm_scores, dtype=np.float64)
  if not np.all(np.isfinite(scores)):
    raise ValueError(f"rm_scores[{int(np.argmin(np.isfinite(scores)))}] is not finite")
  by_domain: dict[str, list[int]] = collections.defaultdict(list)
  for i, record in enumerate(records):
    by_domain[record.get("domain", "math")].append(i)
  normalized = np.zeros_like(scores)
  for indices in by_domain.values():
    domain_scores = scores[indices]
    std = domain_scores.std()
    if std > 0:
      normalized[indices] = (domain_scores - domain_scores.mean()) / std
  count = max(1, round(keep_fraction * len(records)))
  chosen = np.sort(np.argsort(normalized, kind="stable")[:count])
  logging.info("pre-PPO selection: kept %d of %d prompts", count, len(records))
  return [records[i] for i in chosen]


# ----------------------------------------------------------------------------- Reference audit

_DECIMAL = re.compile(r"-?\d+(?:\.\d+)?")


def answer_key(answer: str) -> str:
  """A comparison key: the math reward's normalisation, whitespace dropped, words caseless,
  and decimal numbers as exact fractions (so "2", "2.0" and "02" agree)."""
  key = re.sub(r"\s+", "", math_reward.normalize_answer(answer))
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

