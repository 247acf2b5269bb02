"""Math reward throughput: answers/s of `rl.rewards.math.score_batch` on MATH-500.

  python launch/bench_math_reward.py
  python launch/bench_math_reward.py --num_workers=8 --timeout_s=5

Workloads (gold = MATH-500's `answer`):
* reference solutions: the dataset's worked solutions, ending in \\boxed{gold}; nearly all take
  the exact-match fast path, as right answers do in training.
* off-by-one answers: \\boxed{gold with its first number + 1}; numeric golds are settled as
  decimal literals in this process, the rest go through math-verify in the workers.
* off-by-one, non-numeric golds: the subset of the above that all goes through math-verify,
  i.e. the worker path's own rate.
Each workload gets freshly started, warmed workers (their parse cache is empty).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from launch import cli  # noqa: E402
from rl.data import EVAL_DIR  # noqa: E402
from rl.rewards import math as math_reward  # noqa: E402
from rl.rewards import math_answer  # noqa: E402

_EVAL_DIR = flags.DEFINE_string("eval_dir", EVAL_DIR, "Folder of math500_test.jsonl.")
_NUM_WORKERS = flags.DEFINE_integer("num_workers", 2, "math-verify worker processes.")
_TIMEOUT_S = flags.DEFINE_float("timeout_s", math_reward.DEFAULT_TIMEOUT_S,
                                "Hard limit per math-verify call.")


def off_by_one(gold: str) -> str:
  """The gold with its first number (not a base subscript such as 52_8) increased by one."""
  for run in re.finditer(r"\d+", gold):
    if not re.search(r"_\{?$", gold[:run.start()]):
      bumped = str(int(run.group()) + 1).zfill(len(run.group()))
      return gold[:run.start()] + bumped + gold[run.end():]
  return gold + "+1"


def math500_workloads(eval_dir: str) -> dict[str, tuple[list[str], list[str]]]:
  """name -> (responses, golds) for the workloads in the module docstring."""
  with open(os.path.join(eval_dir, "math500_test.jsonl")) as file:
    rows = [json.loads(line) for line in file]
  golds = [row["answer"] for row in rows]
  wrong = [f"\\boxed{{{off_by_one(gold)}}}" for gold in golds]
  non_numeric = [i for i, gold in enumerate(golds)
                 if not re.fullmatch(r"-?\d+(?:\.\d+)?", math_answer.normalize_answer(gold))]
  return {
      "reference solutions": ([row["solution"] for row in rows], golds),
      "off-by-one answers": (wrong, golds),
      "off-by-one, non-numeric golds": ([wrong[i] for i in non_numeric],
                                        [golds[i] for i in non_numeric]),
  }


def run_benchmark(eval_dir: str, *, num_workers: int, timeout_s: float) -> list[str]:
  """Times score_batch on each workload; returns one report line per workload."""
  lines = []
  for name, (responses, golds) in math500_workloads(eval_dir).items():
    # Fresh workers for each workload: their parse cache would flatter the later ones.
    math_reward.shutdown()
    math_reward.score_batch(["\\boxed{x+1}"] * num_workers, ["x"] * num_workers,
                            num_workers=num_workers)
    start = time.perf_counter()
    _, counts = math_reward.score_batch(responses, golds, timeout_s=timeout_s,
                                        num_workers=num_workers)
    seconds = time.perf_counter() - start
    lines.append(f"{name}: {len(responses)} answers in {seconds:.2f} s = "
                 f"{len(responses) / seconds:.0f} answers/s ({num_workers} workers); {counts}")
  return lines


def main(argv):
  cli.no_arguments(argv)
  for line in run_benchmark(_EVAL_DIR.value, num_workers=_NUM_WORKERS.value,
                            timeout_s=_TIMEOUT_S.value):
    print(line)


if __name__ == "__main__":
  app.run(main)
