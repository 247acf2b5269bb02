"""Prompt selection with the rollout engine: one pass of N samples per training prompt from one of
our checkpoints, graded by the run's verifiers (rl/rewards/manager.py), then one rule of
rl/data/selection.py decides what is written to a prompt-record jsonl, which the trainer (or
SFT) reads back with config.data.source=files, config.data.train_files=<file>. The rules:

* "rejection": each verified response, as an SFT record (selection.keep_verified);
* "worst_of_n": the prompts not solved by every sample (selection.worst_of_n_filter);
* "low_variance": the prompts whose sample accuracies vary (selection.low_variance_removal), the
  offline form of the trainer's dynamic sampling, which drops groups on the same accuracies;
* "audit": the math prompts whose samples agree on a final answer other than the reference
  (selection.reference_audit), each with its sampled answers, for a human to check;
* "pre_ppo": the RLHF data-scaling study's Pre-PPO: each prompt's mean score over its samples
  under the run's graders (config.reward: a reward model for the domains it names),
  z-normalised per domain; the lowest `fraction` is kept (selection.pre_ppo_select) and
  written merged with the original set: every prompt once, the kept ones once more
  (selection.pre_ppo_merge);
* "best_of_n_reference": each record with its best-scored sample as "reference"
  (selection.best_of_n_reference), the study's best-of-N reference for a pairwise GenRM,
  scored by a Bradley-Terry RM (config.reward.graders "general=bt").

`launch/select_prompts.py` is the command line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from models.tokenizer import load_tokenizer
from rl.config.validation import check_paths, validate
from rl.jobs import evaluation, reward_models
from rl.rollout import engine as rollout_lib
from rl.rollout import trajectories
from rl.data import selection
from rl.data.entries import encode_prompts, load_entries
from rl.data.templates import prompt_of
from rl.rewards import manager
from rl.rewards import extract

RULES = ("rejection", "worst_of_n", "low_variance", "audit", "pre_ppo", "best_of_n_reference")

GenerateFn = Callable[[Sequence[dict], int], Sequence[Sequence[str]]]
VerifyFn = Callable[[Sequence[dict], Sequence[str]], Sequence[float]]


@dataclasses.dataclass(frozen=True)
class Outcomes:
  """One pass of n samples per prompt, aligned with `records`: the responses [P][n], their
  verifier accuracies [P, n], and each response's final answer as the math verifier extracts it
  (rl.rewards.extract.math_answer) for math records; None where it states none and for every
  response to a record of another kind."""

  records: list[dict]
  responses: list[list[str]]
  accuracies: np.ndarray
  answers: list[list[str | None]]


def check_rule(rule: str) -> None:
  """Raises a one-line ValueError naming `rule` unless it is one of `RULES`."""
  if rule not in RULES:
    raise ValueError(f"unknown selection rule {rule!r}; expected one of {', '.join(RULES)}")


def sample_outcomes(records: Sequence[dict], generate_fn: GenerateFn, verify_fn: VerifyFn, *,
                    n: int, batch_size: int | None = None) -> Outcomes:
  """Samples `n` responses per record and grades them.

  `generate_fn(records, n)` returns n response strings per record; `verify_fn(records,
  responses)` grades aligned flat lists in one call (one batch of the verifier, e.g.
  rl/rewards/manager.py::score_responses). `batch_size` records go to `generate_fn` at a time
  (default: all). A wrong number of responses or scores is a ValueError naming the prompt.
  """
  if n <= 0:
    raise ValueError(f"n must be positive, got {n}")
  batch_size = batch_size or max(len(records), 1)
  responses, accuracies = [], []
  for start in range(0, len(records), batch_size):
    batch = records[start:start + batch_size]
    batch_responses = [list(samples) for samples in generate_fn(batch, n)]
    if len(batch_responses) != len(batch):
      raise ValueError(f"generate_fn gave responses for {len(batch_responses)} prompts, "
                       f"expected {len(batch)}")
    for offset, samples in enumerate(batch_responses):
      if len(samples) != n:
        raise ValueError(f"generate_fn gave {len(samples)} responses for prompt "
                         f"{start + offset}, expected {n}")
    flat_records = [record for record in batch for _ in range(n)]
    flat_responses = [r for samples in batch_responses for r in samples]
    scores = np.asarray(verify_fn(flat_records, flat_responses), np.float64)
    if scores.shape != (len(flat_responses),):
      raise ValueError(f"verify_fn gave {scores.shape} scores for {len(flat_responses)} "
                       "responses")
    responses.extend(batch_responses)
    accuracies.append(scores.reshape(len(batch), n))
  answers = [[extract.math_answer(r) for r in samples]
             if manager.kind_of(record) == "math" else [None] * n
             for record, samples in zip(records, responses)]
  return Outcomes(records=list(records), responses=responses,
                  accuracies=np.concatenate(accuracies) if accuracies else np.zeros((0, n)),
                  answers=answers)


def apply_rule(outcomes: Outcomes, rule: str, *, min_score: float = 1.0, min_std: float = 1e-6,
               audit_threshold: float = 0.8, fraction: float = 0.1) -> list[dict]:
  """The records `rule` writes: SFT records with a "response" for "rejection", prompt records
  for the others ("audit" adds each flagged record's "sampled_answers"). A sample is solved when
  its accuracy is >= `min_score`; `min_std` is low_variance_removal's, `audit_threshold`
  reference_audit's `threshold` and `fraction` pre_ppo_select's."""
  check_rule(rule)
  records, accuracies = outcomes.records, outcomes.accuracies
  if rule == "rejection":
    return selection.keep_verified(records, outcomes.responses, accuracies, min_score=min_score)
  if rule == "worst_of_n":
    return selection.worst_of_n_filter(records, (accuracies >= min_score).astype(int).tolist())
  if rule == "low_variance":
    return selection.low_variance_removal(records, accuracies.tolist(), min_std=min_std)
  if rule == "pre_ppo":
    kept = selection.pre_ppo_select(records, accuracies.mean(axis=1), fraction=fraction)
    return selection.pre_ppo_merge(records, kept)
  if rule == "best_of_n_reference":
    return selection.best_of_n_reference(records, outcomes.responses, accuracies.tolist())
  flagged = selection.reference_audit(records, outcomes.answers, threshold=audit_threshold)
  return [{**records[i], "sampled_answers": outcomes.answers[i]} for i in flagged]


def write_records(records: Sequence[dict], path: str) -> None:
  """Writes records as jsonl; the file appears complete or not at all (written beside, then
  renamed)."""
  temporary_path = path + ".tmp"
  with open(temporary_path, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  os.replace(temporary_path, path)


def select_prompts(records: Sequence[dict], generate_fn: GenerateFn, verify_fn: VerifyFn, *,
                   rule: str, n: int, out_path: str, batch_size: int | None = None,
                   min_score: float = 1.0, **rule_options) -> tuple[dict[str, int], Outcomes]:
  """Samples and grades `n` responses per record (`sample_outcomes`), writes what `rule` selects
  (`apply_rule`, given `min_score` and `rule_options`) to `out_path` as jsonl, and returns
  (counts, outcomes).

  The rule is checked before anything is sampled. Counts: "prompts", "samples", "correct"
  (solved samples), "prompts_with_correct", "prompts_all_correct" and "written" (lines).
  """
  check_rule(rule)
  outcomes = sample_outcomes(records, generate_fn, verify_fn, n=n, batch_size=batch_size)
  chosen = apply_rule(outcomes, rule, min_score=min_score, **rule_options)
  write_records(chosen, out_path)
  solved = outcomes.accuracies >= min_score
  stats = {"prompts": len(records), "samples": int(solved.size), "correct": int(solved.sum()),
           "prompts_with_correct": int(solved.any(axis=1).sum()),
           "prompts_all_correct": int(solved.all(axis=1).sum()), "written": len(chosen)}
  logging.info("%s selection: %d of %d samples correct over %d prompts; wrote %d records -> %s",
               rule, stats["correct"], stats["samples"], stats["prompts"], stats["written"],
               out_path)
  return stats, outcomes


def sample_and_select(config: ml_collections.ConfigDict, checkpoint: str, *, rule: str, n: int,
                      out_path: str, limit: int = 0, batch_prompts: int = 64, seed: int = 0,
                      **rule_options) -> tuple[dict[str, int], Outcomes]:
  """`select_prompts` on the config's training prompts (the first `limit`, 0: all), sampled
  with config.rollout from an orbax checkpoint of ours (SFT or RL) and graded by the run's
  registry (config.reward: rl/jobs/reward_models.py), as the trainer grades them."""
  check_rule(rule)
  validate(config)
  check_paths(config)
  model, step = evaluation.load_policy_checkpoint(config, checkpoint)
  graphdef, state = nnx.split(model)
  tokenizer = load_tokenizer(config.tokenizer)
  entries, _ = load_entries(config)
  if limit:
    entries = entries[:limit]
  records = [{"prompt": prompt_of(e), **e} for e in entries]
  index_of = {id(r): i for i, r in enumerate(records)}
  prompt_ids = encode_prompts(entries, tokenizer, config.data.prompt_template)
  cfg = rollout_lib.run_rollout_config(
      config, stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id).replace(
          greedy=False, keep_sampling_mask=False, keep_routing=False)
  calls = [0]
  t0 = time.perf_counter()

  def generate_fn(batch, num):
    rng = jax.random.fold_in(jax.random.key(seed), calls[0])
    calls[0] += 1
    traj = trajectories.generate(graphdef, state, [prompt_ids[index_of[id(r)]] for r in batch],
                                 rng, cfg, num_samples=num)
    tokens, mask = np.asarray(traj.tokens), np.asarray(traj.response_mask).astype(bool)
    texts = [tokenizer.decode(tokens[i][mask[i]]) for i in range(len(tokens))]
    logging.info("prompt selection: %d/%d prompts sampled (%.0f s)",
                 min(calls[0] * batch_prompts, len(records)), len(records),
                 time.perf_counter() - t0)
    return [texts[i * num:(i + 1) * num] for i in range(len(batch))]

  logging.info("prompt selection (%s): %d prompts x %d samples from %s (step %d)", rule,
               len(records), n, checkpoint, step)
  graders = reward_models.graders_from_config(config)

  def verify_fn(flat_records, flat_responses):
    return manager.score_responses(flat_records, flat_responses, graders=graders)

  return select_prompts(records, generate_fn, verify_fn, rule=rule, n=n,
                        out_path=out_path, batch_size=batch_prompts, **rule_options)
