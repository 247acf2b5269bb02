"""The one grading registry of the trainer and of evaluation: a record's kind names the grader
that scores responses to it, and both training (rl/jobs/batch.ResponseGrader) and evaluation
(rl/jobs/evaluation.py) call `score_responses`, `vote_key` and `gold_answer` here, so they grade
alike by construction.

A record is either a generated puzzle (`rl/rewards/puzzles.py`: it has a `task` of
`puzzles.TASKS`; kind "puzzle") or a prompt record (`rl/data/sources.py`) whose kind is its
`domain`. The rule graders, `RULES`:

* "math": the math verifier against `answer` (worker processes with hard timeouts), with an
  optional judge where the rules cannot settle (rl/rewards/math.py);
* "code": the sandbox against `tests`, all must pass. A test is a dict with `input`/`stdin` and
  `output`/`expected_stdout` (a stdio case), or a string of Python appended to the program (an
  assert case). An evaluation record may instead carry its `code_problem` (a CodeProblem) and
  `completion=True` (the response continues the problem's prefix, e.g. HumanEval's plain
  prompts);
* "puzzle": the task's verifier;
* "planted": general prompts of the planted-preference task, 1.0 where the response ends with
  the planted marker (rl/rewards/planted.py): the held-out property rate of a run whose general
  prompts a reward model scores.

A run's registry (rl/jobs/reward_models.py `graders_from_config`) starts from RULES and replaces
or adds the graders config.reward.graders names per domain (reward models among them,
rl/rewards/rm_graders.py). A new grader is one class with the three methods of `RecordGrader`.

Model output is never evaluated in this process. A record that cannot be graded (no answer, no
tests, a kind without a grader) raises ValueError naming its data source and prompt.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from rl.rewards import code as code_reward
from rl.rewards import extract
from rl.rewards import math as math_reward
from rl.rewards import math_answer, puzzles
from rl.rewards.planted import PlantedRule

# Where a plain completion of a HumanEval prompt leaves the function body (the Codex paper's stop
# sequences): what follows is the model writing on, not part of the solution.
CODE_STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


class RecordGrader(Protocol):
  """Grades responses to records of one kind."""

  def grade(self, entries: Sequence[Mapping[str, Any]], responses: Sequence[str], *,
            workers: int) -> np.ndarray:
    """Score in [0, 1] per (entry, response), the whole batch in one call."""

  def vote_key(self, entry: Mapping[str, Any], response: str) -> str | None:
    """The normalised answer a response votes for in maj@n (None: no vote)."""

  def gold_answer(self, entry: Mapping[str, Any]) -> str | None:
    """The record's gold final answer or reference as text (None when it has none)."""


def question_of(entry: Mapping[str, Any]) -> str:
  """The question a record asks: its "prompt" (records), else its "question" (puzzles)."""
  return str(entry.get("prompt", entry.get("question", "")))


def describe(entry: Mapping[str, Any]) -> str:
  prompt = question_of(entry)
  return f"data_source={entry.get('data_source', '?')!r}, prompt={prompt[:60]!r}"


def kind_of(entry: Mapping[str, Any]) -> str:
  """"puzzle" for a generated puzzle, else the record's domain (default "math")."""
  if entry.get("task") in puzzles.TASKS:
    return "puzzle"
  return entry.get("domain", "math")


# ======================================================================== Rule graders

class MathRule:
  """The math verifier against `answer`; `judge` (rl/rewards/math.py Judge, batched) settles
  only what the rules cannot."""

  def __init__(self, judge: math_reward.Judge | None = None):
    self.judge = judge

  def grade(self, entries, responses, *, workers):
    golds = []
    for entry in entries:
      if not entry.get("answer"):
        raise ValueError(f"math record without an answer ({describe(entry)})")
      golds.append(str(entry["answer"]))
    scores, _ = math_reward.score_batch(list(responses), golds, num_workers=workers,
                                        judge=self.judge,
                                        questions=[question_of(e) for e in entries])
    return np.asarray(scores, np.float32)

  def vote_key(self, entry, response):
    answer = extract.math_answer(response)
    return None if answer is None else math_answer.normalize_answer(answer)

  def gold_answer(self, entry):
    return entry.get("answer")


def code_problem(entry: Mapping[str, Any]) -> code_reward.CodeProblem:
  """The sandbox problem of a code record."""
  if entry.get("code_problem") is not None:
    return entry["code_problem"]
  tests = []
  for test in entry.get("tests") or ():
    if isinstance(test, str):
      tests.append(code_reward.AssertTest(test))
    elif isinstance(test, Mapping):
      stdin = test.get("input", test.get("stdin"))
      expected = test.get("output", test.get("expected_stdout"))
      if stdin is None or expected is None:
        raise ValueError(f"code test {dict(test)!r} needs input and output ({describe(entry)})")
      tests.append(code_reward.StdioTest(str(stdin), str(expected)))
    else:
      raise ValueError(f"code test of type {type(test).__name__} ({describe(entry)})")
  if not tests:
    raise ValueError(f"code record without tests ({describe(entry)})")
  return code_reward.CodeProblem(tests=tuple(tests))


def program_of(entry: Mapping[str, Any], response: str) -> str:
  """The program text a code response gives: a completion up to the first line that leaves
  the function body (CODE_STOP_SEQUENCES), else the first fenced block (the whole response
  when there is none), on a fresh line after the problem's prefix."""
  if entry.get("completion"):
    cut = min((i for i in (response.find(s) for s in CODE_STOP_SEQUENCES) if i >= 0),
              default=len(response))
    return response[:cut]
  program = extract.program_text(response)
  return "\n" + program if code_problem(entry).prefix else program


class CodeRule:
  """The sandbox: 1 when every test passes."""

  def grade(self, entries, responses, *, workers):
    results = code_reward.grade_batch([program_of(e, r) for e, r in zip(entries, responses)],
                                      [code_problem(e) for e in entries], workers=workers)
    return np.array([float(r.all_passed) for r in results], np.float32)

  def vote_key(self, entry, response):
    return None  # a program is not an answer to vote on

  def gold_answer(self, entry):
    return None


class PuzzleRule:
  """The puzzle task's verifier."""

  def grade(self, entries, responses, *, workers):
    return np.array([puzzles.score(e, r) for e, r in zip(entries, responses)], np.float32)

  def vote_key(self, entry, response):
    answer = " ".join(extract.puzzle_answer(response).split())
    return answer or None

  def gold_answer(self, entry):
    return entry.get("answer")


RULES: dict[str, RecordGrader] = {"math": MathRule(), "code": CodeRule(),
                                  "puzzle": PuzzleRule(), "planted": PlantedRule()}


# ======================================================================== Dispatch

def grader_of(entry: Mapping[str, Any], graders: Mapping[str, RecordGrader]) -> RecordGrader:
  kind = kind_of(entry)
  if kind not in graders:
    raise ValueError(f"no grader for domain {kind!r} (graders: {', '.join(sorted(graders))}; "
                     f"config.reward.graders names one per domain; {describe(entry)})")
  return graders[kind]


def check_graded(entries: Sequence[Mapping[str, Any]], graders: Collection[str]) -> None:
  """Every record's kind is one of `graders` (a registry or its kinds): ValueError naming the
  first domain without a grader."""
  for kind in dict.fromkeys(kind_of(e) for e in entries):
    if kind not in graders:
      first = next(e for e in entries if kind_of(e) == kind)
      raise ValueError(f"config.reward.graders: no grader for domain {kind!r} (records such as "
                       f"{describe(first)}); name one, e.g. {kind}=genrm")


def score_responses(entries: Sequence[Mapping[str, Any]], responses: Sequence[str], *,
                    workers: int = 2,
                    graders: Mapping[str, RecordGrader] = RULES) -> np.ndarray:
  """Score in [0, 1] per (entry, response), grading each kind in one batch."""
  if len(entries) != len(responses):
    raise ValueError(f"{len(responses)} responses for {len(entries)} entries")
  acc = np.zeros(len(entries), np.float32)
  for entry in entries:
    grader_of(entry, graders)
  kinds = np.array([kind_of(e) for e in entries])
  for kind in dict.fromkeys(kinds.tolist()):
    rows = np.flatnonzero(kinds == kind)
    acc[rows] = graders[kind].grade([entries[i] for i in rows], [responses[i] for i in rows],
                                    workers=workers)
  return acc


def vote_key(entry: Mapping[str, Any], response: str,
             graders: Mapping[str, RecordGrader] = RULES) -> str | None:
  return grader_of(entry, graders).vote_key(entry, response)


def gold_answer(entry: Mapping[str, Any],
                graders: Mapping[str, RecordGrader] = RULES) -> str | None:
  return grader_of(entry, graders).gold_answer(entry)
