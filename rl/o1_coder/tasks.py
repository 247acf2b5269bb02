"""Generated programming tasks for the O1-Coder loop, and the text format of reasoning paths.

A task is a one-line question ("Read two ints a b. Print their sum plus k, where k = 3."), a
reference solution that reads stdin and prints the answer, and a trusted Python function that
computes the expected output of an input (our own template code, so it runs in this process;
model output never does). Tasks come from a few families: two-int arithmetic with an offset, and
string operations with a count.

Reasoning path. The policy answers with pseudocode steps and then the code, one step per
marker (O1-Coder's three actions):

    [plan] k=3; read a b; out sum + k               define the algorithm structure
    [refine] x=a+b+3; print x                       refine the pseudocode
    [code]                                          generate code from the pseudocode
    a,b=map(int,input().split())
    print(a+b+3)

`reasoning_trace` writes such a path for a task; with `wrong_op` / `wrong_count` it writes a
consistent but wrong path (a plausible distractor), which the SFT warm start mixes in so that
search trees have good and bad branches at both pseudocode steps. Every question ends with
"k = <count>." and every plan starts with "k=<count>;": the count sits at the same distance
before the plan in every task, which is what lets a two-layer byte model copy it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

PLAN, REFINE, CODE = "[plan]", "[refine]", "[code]"
ACTIONS = (PLAN, REFINE, CODE)

# name: (question phrase, plan phrase, expression template over a, b and k, trusted function)
_INT_OPS: dict[str, tuple[str, str, str, Callable[[int, int, int], int]]] = {
    "sum": ("sum", "sum", "a+b+{k}", lambda a, b, k: a + b + k),
    "difference": ("difference a-b", "diff", "a-b+{k}", lambda a, b, k: a - b + k),
    "product": ("product", "prod", "a*b+{k}", lambda a, b, k: a * b + k),
    "max": ("maximum", "max", "max(a,b)+{k}", lambda a, b, k: max(a, b) + k),
    "min": ("minimum", "min", "min(a,b)+{k}", lambda a, b, k: min(a, b) + k),
}
_STRING_OPS: dict[str, tuple[str, str, str, Callable[[str, int], str]]] = {
    "prefix": ("the first k characters of the line", "first k", "s[:{k}]",
               lambda s, k: s[:k]),
    "suffix": ("the last k characters of the line", "last k", "s[-{k}:]",
               lambda s, k: s[-k:]),
    "repeat": ("the line repeated k times", "repeat k", "s*{k}", lambda s, k: s * k),
    "reverse_repeat": ("the reversed line repeated k times", "rev repeat k", "s[::-1]*{k}",
                       lambda s, k: s[::-1] * k),
}
# The counts k each operation takes (repetitions stay short: test cases are written out).
_COUNTS = {"int": range(0, 10), "prefix": range(1, 7), "suffix": range(1, 7),
           "repeat": range(2, 4), "reverse_repeat": range(1, 4)}


@dataclasses.dataclass(frozen=True)
class CodingTask:
  """One generated programming task: family ("int" or "string"), operation and count k."""

  family: str
  op: str
  k: int

  @property
  def question(self) -> str:
    if self.family == "int":
      return f"Read two ints a b. Print their {_INT_OPS[self.op][0]} plus k, where k = {self.k}."
    return f"Read a line. Print {_STRING_OPS[self.op][0]}, where k = {self.k}."

  @property
  def prompt(self) -> str:
    """What the policy is conditioned on; its response is the reasoning path."""
    return f"Task: {self.question}\n"

  def expected_output(self, stdin: str) -> str:
    """The correct output for `stdin` (trusted template code)."""
    if self.family == "int":
      a, b = map(int, stdin.split())
      return str(_INT_OPS[self.op][3](a, b, self.k))
    return _STRING_OPS[self.op][3](stdin.strip(), self.k)

  def random_input(self, rng: np.random.Generator) -> str:
    if self.family == "int":
      # Small operands: the test-case generator has to write the outputs itself.
      return f"{rng.integers(0, 10)} {rng.integers(0, 10)}"
    letters = rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(3, 7))
    return "".join(letters)

  def test_cases(self, n: int, seed: int) -> list[tuple[str, str]]:
    """`n` (stdin, expected stdout) cases with distinct inputs."""
    rng = np.random.default_rng([seed, *map(ord, self.question)])
    cases: dict[str, str] = {}
    while len(cases) < n:
      stdin = self.random_input(rng)
      cases.setdefault(stdin, self.expected_output(stdin))
    return list(cases.items())

  @property
  def reference_solution(self) -> str:
    return reasoning_trace(self).split(f"{CODE}\n", 1)[1]


def _expression(task: CodingTask, op: str, k: int) -> str:
  table = _INT_OPS if task.family == "int" else _STRING_OPS
  return table[op][2].format(k=k)


def reasoning_trace(task: CodingTask, *, wrong_op: str | None = None,
                    wrong_count: int | None = None) -> str:
  """The path plan -> refine -> code for `task`. `wrong_op` swaps the operation from the plan
  on; `wrong_count` keeps the plan and puts another k into the refinement and the code."""
  op = wrong_op or task.op
  plan_k = task.k
  code_k = task.k if wrong_count is None else wrong_count
  expression = _expression(task, op, code_k)
  if task.family == "int":
    plan = f"{PLAN} k={plan_k}; read a b; out {_INT_OPS[op][1]} + k"
    refine = f"{REFINE} x={expression}; print x"
    code = f"a,b=map(int,input().split())\nprint({expression})"
  else:
    plan = f"{PLAN} k={plan_k}; read s; out {_STRING_OPS[op][1]}"
    refine = f"{REFINE} x={expression}; print x"
    code = f"s=input().strip()\nprint({expression})"
  return f"{plan}\n{refine}\n{CODE}\n{code}"


def distractor_trace(task: CodingTask, rng: np.random.Generator) -> str:
  """A consistent wrong path: another operation of the family (half the time) or another k."""
  if rng.random() < 0.5:
    ops = [op for op in (_INT_OPS if task.family == "int" else _STRING_OPS) if op != task.op]
    return reasoning_trace(task, wrong_op=str(rng.choice(ops)))
  counts = [k for k in _counts(task) if k != task.k]
  return reasoning_trace(task, wrong_count=int(rng.choice(counts)))


def _counts(task: CodingTask) -> range:
  return _COUNTS["int" if task.family == "int" else task.op]


def all_tasks() -> list[CodingTask]:
  """Every task of every family: 5 int operations x 10 offsets, 4 string ones x 3-6 counts."""
  tasks = [CodingTask("int", op, k) for op in _INT_OPS for k in _COUNTS["int"]]
  tasks += [CodingTask("string", op, k) for op in _STRING_OPS for k in _COUNTS[op]]
  return tasks


def split_tasks(seed: int, heldout_fraction: float = 0.25
                ) -> tuple[list[CodingTask], list[CodingTask]]:
  """(train, held-out): a seeded shuffle of every task, the held-out ones never trained on."""
  tasks = all_tasks()
  order = np.random.default_rng(seed).permutation(len(tasks))
  heldout_count = max(1, int(round(heldout_fraction * len(tasks))))
  shuffled = [tasks[i] for i in order]
  return shuffled[heldout_count:], shuffled[:heldout_count]


# ----------------------------------------------------------------------------- Path text


def split_steps(response: str) -> list[str]:
  """The steps of a response: each starts at a line beginning with an action marker; text
  before the first marker is dropped. The code step runs to the end of the response."""
  steps: list[str] = []
  for line in response.split("\n"):
    if line.startswith(ACTIONS) or not steps:
      if line.startswith(ACTIONS):
        steps.append(line)
      continue
    if steps[-1].startswith(CODE):
      steps[-1] += "\n" + line
  return steps


def join_steps(steps: Sequence[str]) -> str:
  """Inverse of `split_steps` for well-formed steps."""
  return "\n".join(steps)


def action_of(step: str) -> str | None:
  return next((a for a in ACTIONS if step.startswith(a)), None)


def program_of(steps: Sequence[str]) -> str | None:
  """The code of a path (its last step, when that is a code step), else None."""
  if not steps or action_of(steps[-1]) != CODE:
    return None
  return steps[-1][len(CODE):].lstrip("\n")
