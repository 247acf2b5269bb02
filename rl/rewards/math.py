"""Rule-based math rewards: extract a response's final answer and grade it against the gold.

Pipeline for one (response, gold) pair, all string work in the caller's process:

1. Extract (`extract.math_answer`): the last complete `\\boxed{..}` / `\\fbox{..}` (balanced
   braces), else the last `Answer: ..` line (DAPO's format), else the rest of the last "the
   answer is .." sentence, else the last number in the text. No answer at all scores wrong.
2. Normalise (`math_answer.normalize_answer`): LaTeX variants, units, separators and padding
   dropped (math_answer.py lists each rule).
3. Compare, by the answer rules of math_answer.py (decimals are exact, units must agree when
   both sides have one, leading zeros are significant): equal normalised strings score right at
   once; two plain decimal literals are compared exactly as fractions; everything else goes to
   math-verify in a worker process (math_verifier.py, with its guards against false positives).

Bounded time. Extraction is linear in the response (every scan stops where an earlier one
started), responses over MAX_RESPONSE_CHARS score wrong unread (counted), answers over
MAX_ANSWER_CHARS too, and math-verify has a hard deadline per call: one response costs at most
about a second of the caller's CPU, whatever its text. The caller never parses model output
with sympy: the process's `VerifierPool` (started on first use, grown to `num_workers`, stopped
by `shutdown` or at exit) does.

Judge. Where the rules cannot settle (either side failed to parse), `judge(questions, golds,
answers) -> [0, 1] each` decides if given, else the answer scores wrong. It is called once per
batch with every unsettled answer, so a model judge runs one batched forward.
`rl/rewards/genrm.py` provides a Seed-Verifier-style judge built on our own models: `make_math_judge(rm)`. A judge
score is a probability, returned as the reward unchanged (clipped to [0, 1]).

Modes. "verify": 1.0 right, 0.0 wrong. "dapo": DAPO's strict rule, +1 when the text after the
last "Answer:" (`extract.answer_line`) normalises to the normalised gold, else -1 (no
math-verify, no judge).

Every call counts the path it took (`PathCounts`): `score_batch` returns the batch's counts and
`path_counts()` the totals since import.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
from collections.abc import Callable, Sequence

from rl.rewards import extract
from rl.rewards import math_verifier
from rl.rewards.math_answer import rule_verdict

DEFAULT_TIMEOUT_S = 5.0
# Longer "answers" are not final answers; they would only cost normalisation and worker time.
MAX_ANSWER_CHARS = 1000
# Longer responses score wrong unread. Far above any generation length (a 128k-token response
# is ~0.5M characters), it bounds one response's grading: extraction is linear, about 0.1-0.3 s
# per million characters on one core, and math-verify runs under its own deadline.
MAX_RESPONSE_CHARS = 1 << 20

Judge = Callable[[Sequence[str], Sequence[str], Sequence[str]], Sequence[float]]

# ---------------------------------------------------------------------- Shared worker pool

_pool: math_verifier.VerifierPool | None = None
_pool_owner_pid: int | None = None
_pool_lock = threading.Lock()


def _shared_pool(num_workers: int) -> math_verifier.VerifierPool:
  """The process's pool, grown to `num_workers`. A forked child gets its own: the inherited
  pipes lead to its parent's workers."""
  global _pool, _pool_owner_pid
  if _pool is None or _pool_owner_pid != os.getpid():
    _pool, _pool_owner_pid = math_verifier.VerifierPool(num_workers), os.getpid()
  _pool.grow(num_workers)
  return _pool


def shutdown() -> None:
  """Stops the shared worker pool (the next call starts a fresh one)."""
  global _pool
  with _pool_lock:
    if _pool is not None and _pool_owner_pid == os.getpid():
      _pool.close()
    _pool = None


atexit.register(shutdown)


# ----------------------------------------------------------------------------- Scoring

@dataclasses.dataclass
class PathCounts:
  """How many answers took each grading path.

  no_answer: nothing extracted. exact_match: normalised strings equal. literal: both plain
  decimal numbers, compared exactly. verified_correct / verified_wrong: math-verify's verdict
  (guards passed). guarded: math-verify said equal, the exact-number guard said different.
  unparsed: a side failed to parse and no judge was given. judged: settled by the judge.
  timeouts: the worker overran its deadline and was replaced. errors: the worker raised or died.
  too_long: answer over MAX_ANSWER_CHARS. response_too_long: response over MAX_RESPONSE_CHARS
  (not read at all). unit_mismatch / digits_mismatch: wrong by the unit / leading-zero rule.
  dapo_match / dapo_mismatch: mode="dapo" outcomes.
  """
  no_answer: int = 0
  exact_match: int = 0
  literal: int = 0
  unit_mismatch: int = 0
  digits_mismatch: int = 0
  verified_correct: int = 0
  verified_wrong: int = 0
  guarded: int = 0
  unparsed: int = 0
  judged: int = 0
  timeouts: int = 0
  errors: int = 0
  too_long: int = 0
  response_too_long: int = 0
  dapo_match: int = 0
  dapo_mismatch: int = 0

  def add(self, other: PathCounts) -> None:
    for field in dataclasses.fields(self):
      setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


_totals = PathCounts()
_totals_lock = threading.Lock()


def _add_to_totals(counts: PathCounts) -> None:
  with _totals_lock:
    _totals.add(counts)


def path_counts() -> PathCounts:
  """Totals of every path taken in this process since import (a copy)."""
  with _totals_lock:
    return dataclasses.replace(_totals)


def _score_dapo(responses: Sequence[str], golds: Sequence[str],
                counts: PathCounts) -> list[float]:
  scores = []
  for response, gold in zip(responses, golds):
    if len(response) > MAX_RESPONSE_CHARS:
      counts.response_too_long += 1
      answer = None
    else:
      answer = extract.answer_line(response)
    matched = (answer is not None and len(answer) <= MAX_ANSWER_CHARS
               and rule_verdict(answer, gold)[0] == "exact_match")
    counts.dapo_match += matched
    counts.dapo_mismatch += not matched
    scores.append(1.0 if matched else -1.0)
  return scores


def score_batch(responses: Sequence[str], golds: Sequence[str], *, mode: str = "verify",
                timeout_s: float = DEFAULT_TIMEOUT_S, num_workers: int = 2,
                judge: Judge | None = None,
                questions: Sequence[str] | None = None) -> tuple[list[float], PathCounts]:
  """Scores many responses; returns (scores, this batch's PathCounts).

  Args:
    responses, golds: model outputs and gold final answers (e.g. MATH's `answer`, the text after
      GSM8K's "#### "), same length.
    mode: "verify" (1.0 / 0.0, or the judge's probability) or "dapo" (+1 / -1).
    timeout_s: hard wall-clock limit per math-verify call; an overrun scores wrong.
    num_workers: worker processes (the shared pool grows to this size and stays).
    judge: callable(questions, golds, answers) -> [0, 1] each, called once with the answers
      where a side fails to parse, and only then.
    questions: the problems, passed to the judge (empty strings when omitted).
  """
  if len(responses) != len(golds):
    raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
  if mode not in ("verify", "dapo"):
    raise ValueError(f"unknown math reward mode {mode!r}; expected 'verify' or 'dapo'")
  counts = PathCounts()
  if mode == "dapo":
    scores = _score_dapo(responses, golds, counts)
    _add_to_totals(counts)
    return scores, counts

  scores: list[float] = [0.0] * len(responses)
  answers: list[str | None] = [None] * len(responses)
  to_verify: dict[tuple[str, str], list[int]] = {}  # identical pairs are verified once
  for index, (response, gold) in enumerate(zip(responses, golds)):
    if len(response) > MAX_RESPONSE_CHARS:
      counts.response_too_long += 1
      continue
    answer = extract.math_answer(response)
    if answer is None:
      counts.no_answer += 1
      continue
    if len(answer) > MAX_ANSWER_CHARS:
      counts.too_long += 1
      continue
    answers[index] = answer
    verdict, answer_normalized, gold_normalized = rule_verdict(answer, gold)
    if verdict is not None:
      field = verdict.removesuffix("_right").removesuffix("_wrong")
      setattr(counts, field, getattr(counts, field) + 1)
      scores[index] = float(verdict in ("exact_match", "literal_right"))
      continue
    to_verify.setdefault((gold_normalized, answer_normalized), []).append(index)

  to_judge: list[int] = []
  if to_verify:
    pairs = list(to_verify)
    with _pool_lock:
      verdicts = _shared_pool(num_workers).check(pairs, timeout_s)
    for pair, verdict in zip(pairs, verdicts):
      for index in to_verify[pair]:
        if verdict == math_verifier.CORRECT:
          counts.verified_correct += 1
          scores[index] = 1.0
        elif verdict == math_verifier.UNPARSED and judge is not None:
          counts.judged += 1
          to_judge.append(index)
        else:
          counts.verified_wrong += verdict == math_verifier.WRONG
          counts.guarded += verdict == math_verifier.GUARDED
          counts.unparsed += verdict == math_verifier.UNPARSED
          counts.timeouts += verdict == math_verifier.TIMEOUT
          counts.errors += verdict == math_verifier.ERROR
  if to_judge:
    judged = judge([questions[i] if questions is not None else "" for i in to_judge],
                   [golds[i] for i in to_judge], [answers[i] for i in to_judge])
    for index, value in zip(to_judge, judged):
      scores[index] = min(1.0, max(0.0, float(value)))
  _add_to_totals(counts)
  return scores, counts


def score(response: str, gold: str, *, mode: str = "verify",
          timeout_s: float = DEFAULT_TIMEOUT_S, judge: Judge | None = None,
          question: str = "") -> float:
  """The reward of one response (see `score_batch`; uses the shared pool, one worker or more)."""
  scores, _ = score_batch([response], [gold], mode=mode, timeout_s=timeout_s, num_workers=1,
                          judge=judge, questions=[question])
  return scores[0]


def is_correct(response: str, gold: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
               judge: Judge | None = None, question: str = "") -> bool:
  """Whether the response's final answer matches the gold (a judge's P(yes) >= 0.5 counts)."""
  return score(response, gold, timeout_s=timeout_s, judge=judge, question=question) >= 0.5
