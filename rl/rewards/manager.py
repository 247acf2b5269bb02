"""One call that grades a batch of responses whatever their kind: the reward manager of the
trainer and of evaluation.

An entry is either a generated puzzle (`rl/rewards/puzzles.py`: it has a `task` of
`puzzles.TASKS`) or a prompt record (`rl/data/sources.py`) graded by its `domain`:

* "math": the math verifier against `answer` (worker processes with hard timeouts);
* "code": the sandbox against `tests`, all must pass. A test is a dict with `input`/`stdin` and
  `output`/`expected_stdout` (a stdio case), or a string of Python appended to the program (an
  assert case);
* "logic" records that carry a puzzle `task` use that task's verifier.

Model output is never evaluated in this process. A record that cannot be graded (no answer, no
tests, an unknown domain) raises ValueError naming its data source and prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


import numpy as np

from rl.rewards import code as code_reward
from rl.rewards import extract
from rl.rewards import math as math_reward
from rl.rewards import puzzles


def kind_of(entry: Mapping[str, Any]) -> str:
  """"puzzle", "math" or "code"."""
  if entry.get("task") in puzzles.TASKS:
    return "puzzle"
  domain = entry.get("domain", "math")
  if domain in ("math", "code"):
    return domain
  raise ValueError(f"cannot grade a {domain!r} record without a puzzle task "
                   f"({_describe(entry)})")


def _describe(entry: Mapping[str, Any]) -> str:
  prompt = str(entry.get("prompt", entry.get("question", "")))
  return f"data_source={entry.get('data_source', '?')!r}, prompt={prompt[:60]!r}"


def code_problem(entry: Mapping[str, Any]) -> code_reward.CodeProblem:
  """The sandbox problem of a code record."""
  tests = []
  for test in entry.get("tests") or ():
    if isinstance(test, str):
      tests.append(code_reward.AssertTest(test))
    elif isinstance(test, Mapping):
      stdin = test.get("input", test.get("stdin"))
      expected = test.get("output", test.get("expected_stdout"))
      if stdin is None or expected is None:
        raise ValueError(f"code test {dict(test)!r} needs input and output ({_describe(entry)})")
      tests.append(code_reward.StdioTest(str(stdin), str(expected)))
    else:
      raise ValueError(f"code test of type {type(test).__name__} ({_describe(entry)})")
  if not tests:
    raise ValueError(f"code record without tests ({_describe(entry)})")
  return code_reward.CodeProblem(tests=tuple(tests))


def score_responses(entries: Sequence[Mapping[str, Any]], responses: Sequence[str], *,
                    workers: int = 2) -> np.ndarray:
  """Accuracy in [0, 1] per (entry, response), grading each kind in one batch."""
  if len(entries) != len(responses):
    raise ValueError(f"{len(responses)} responses for {len(entries)} entries")
  acc = np.zeros(len(entries), np.float32)
  kinds = np.array([kind_of(e) for e in entries])
  for kind in set(kinds.tolist()):
    rows = np.flatnonzero(kinds == kind)
    if kind == "puzzle":
      acc[rows] = [puzzles.score(entries[i], responses[i]) for i in rows]
    elif kind == "math":
      golds = []
      for i in rows:
        if not entries[i].get("answer"):
          raise ValueError(f"math record without an answer ({_describe(entries[i])})")
        golds.append(str(entries[i]["answer"]))
      scores, _ = math_reward.score_batch([responses[i] for i in rows], golds,
                                          num_workers=workers)
      acc[rows] = scores
    else:
      results = code_reward.grade_batch([extract.program_text(responses[i]) for i in rows],
                                        [code_problem(entries[i]) for i in rows],
                                        workers=workers)
      acc[rows] = [float(r.all_passed) for r in results]
  return acc
