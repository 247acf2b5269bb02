"""math-verify in worker processes: the equivalence check of two normalised math answers, with a
hard deadline on every call. The math reward (math.py) sends here only the pairs that the
answer rules of math_answer.py leave open.

Workers. math-verify parses and compares with sympy, which can hang or exhaust memory on model
output (`9^9^9^9^9`), and its own timeouts use `signal.alarm`, which only works on a main thread.
So `VerifierPool.check` runs (gold, answer) pairs (gold first: the check is not symmetric) in
long-lived worker processes (plain subprocesses that load this file alone: no re-import of the
caller's main module, no JAX; it imports nothing but the standard library at the top). Every
call has a hard wall-clock deadline: a worker that overruns is killed and replaced and the call
scores wrong. Workers also run under an address-space limit, so a huge power fails with
MemoryError instead of taking the machine's memory. The caller never parses model output with
sympy.

Guards against math-verify's false positives (checked in the worker):
* Partial parses: math-verify's default extractors fall back to any piece they can parse (plain
  "1-1/e" reads as 1, "1/2^{99" as 1). Each side is parsed as `$..$` with the LaTeX extractor
  alone, whose parser must accept the whole string, and the text math-verify kept must not be a
  strict piece of the answer ("5 apples" -> "5"). Otherwise the side counts as unparsed.
* Tiny numeric differences: math-verify compares numbers after rounding to 6 decimals, so
  1/2^99 "equals" 1/2^98. When it says equal, numbers (also inside tuples, intervals, matrices
  and finite sets) are re-checked with decimals read as exact fractions: the values must be
  exactly equal (sympy simplify, then a 60-digit evaluation with relative tolerance 1e-50).
"""

from __future__ import annotations

import collections
import functools
import json
import multiprocessing.connection
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

DEFAULT_WORKER_MEMORY_MB = 2048
_WORKER_START_TIMEOUT_S = 120.0

# Verdicts of one check, as the workers write them.
CORRECT, WRONG, UNPARSED, GUARDED = "correct", "wrong", "unparsed", "guarded"
TIMEOUT, ERROR = "timeout", "error"

# ----------------------------------------------------------------------------- Worker side

@functools.lru_cache(maxsize=4096)  # golds repeat across a group, and so do common answers
def _parse_whole(answer: str):
  """The sympy object for the whole answer, or None (no parse, or only part of it parsed)."""
  from math_verify import LatexExtractionConfig, parse  # worker-only: the caller never loads sympy
  # LaTeX extraction only: math-verify's plain-expression extractor is what reads a piece of an
  # answer it cannot parse whole ("1-1/e" as 1, "1/2^{99" as 1, "5)" as 5).
  parsed = parse(f"${answer}$", [LatexExtractionConfig()], parsing_timeout=None)
  if len(parsed) < 2 or isinstance(parsed[0], str):
    return None  # [] or a bare-string fallback: nothing parsed
  expression, matched = parsed
  whole, piece = re.sub(r"\s+", "", answer), re.sub(r"\s+", "", str(matched))
  if piece != whole and piece in whole:
    return None  # math-verify's normalisation kept only part of it ("5 apples" -> 5)
  return expression


def _aligned_numbers(gold, answer) -> list:
  """Pairs of numeric sub-values at matching positions, as far as the structures line up."""
  import sympy
  if isinstance(gold, sympy.MatrixBase) and isinstance(answer, sympy.MatrixBase):
    if gold.shape != answer.shape:
      return []
    return [pair for g, a in zip(gold, answer) for pair in _aligned_numbers(g, a)]
  if not isinstance(gold, sympy.Basic) or not isinstance(answer, sympy.Basic):
    return []
  if gold.is_number and answer.is_number and not gold.free_symbols and not answer.free_symbols:
    return [(gold, answer)]
  gold_is_equation, answer_is_equation = (isinstance(gold, sympy.Eq),
                                          isinstance(answer, sympy.Eq))
  if gold_is_equation and answer_is_equation:
    # Only "x = value" against "x = value": other equations may be rearrangements.
    same_variable = gold.lhs == answer.lhs and gold.lhs.is_Symbol
    return _aligned_numbers(gold.rhs, answer.rhs) if same_variable else []
  if gold_is_equation or answer_is_equation:  # math-verify matches "x = 5" with "5"
    return _aligned_numbers(gold.rhs if gold_is_equation else gold,
                            answer.rhs if answer_is_equation else answer)
  if isinstance(gold, sympy.Interval) and isinstance(answer, sympy.Interval):
    return [(gold.start, answer.start), (gold.end, answer.end)]
  if isinstance(gold, sympy.Tuple) and isinstance(answer, sympy.Tuple):
    if len(gold) != len(answer):
      return []
    return [pair for g, a in zip(gold, answer) for pair in _aligned_numbers(g, a)]
  if isinstance(gold, sympy.FiniteSet) and isinstance(answer, sympy.FiniteSet):
    members = list(gold), list(answer)
    if len(members[0]) != len(members[1]) or not all(
        m.is_number for side in members for m in side):
      return []

    def position(value):
      point = complex(sympy.N(value, 30))
      return point.real, point.imag

    return list(zip(sorted(members[0], key=position), sorted(members[1], key=position)))
  return []


def _exact_decimals(value):
  """`value` with each decimal (a sympy Float, which keeps every digit written) replaced by the
  exact rational it writes: 0.333333 is 333333/10^6, not 1/3."""
  import sympy
  return value.xreplace({f: sympy.Rational(str(f)) for f in value.atoms(sympy.Float)})


def _numbers_differ(gold, answer) -> bool:
  """True when two numbers that math-verify called equal are in fact different values
  (decimals are the exact values they write)."""
  import sympy
  gold, answer = _exact_decimals(gold), _exact_decimals(answer)
  if gold == answer:
    return False
  difference = sympy.simplify(gold - answer)
  if difference == 0:
    return False
  # simplify cannot prove every identity; a 60-digit evaluation settles the rest.
  scale = max(abs(sympy.N(gold, 60)), abs(sympy.N(answer, 60)))
  return bool(abs(sympy.N(difference, 60)) > sympy.Float("1e-50") * scale)


def _check_equivalence(gold: str, answer: str) -> str:
  """Worker-side verdict for two normalised answers: correct / wrong / unparsed / guarded."""
  from math_verify import verify
  gold_expression = _parse_whole(gold)
  answer_expression = _parse_whole(answer)
  if gold_expression is None or answer_expression is None:
    return UNPARSED
  if not verify(gold_expression, answer_expression, timeout_seconds=None):
    return WRONG
  if any(_numbers_differ(g, a) for g, a in _aligned_numbers(gold_expression, answer_expression)):
    return GUARDED
  return CORRECT


def _die_with_parent() -> None:
  """Linux: SIGKILL this worker when the parent dies, even mid-computation (stdin EOF would
  only be seen between requests, and a stuck computation never gets there)."""
  parent = os.getppid()
  try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
  except (OSError, AttributeError):
    return
  if os.getppid() != parent:
    os._exit(1)


def _worker_main(memory_mb: int) -> None:
  """Serve JSON-line (gold, answer) requests on stdin until it closes; one verdict line each."""
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
  _die_with_parent()
  limit = memory_mb * 1024 * 1024
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  # Keep the real stdout for verdicts; anything sympy or math-verify prints goes to stderr.
  replies = os.fdopen(os.dup(1), "wb", buffering=0)
  os.dup2(2, 1)
  import logging
  import math_verify  # noqa: F401  (loaded before "ready" so deadlines never include it)
  # Its warnings (timeouts disabled: ours are external; parse failures of model output) are
  # expected here and would flood the trainer's stderr.
  logging.getLogger("math_verify").setLevel(logging.CRITICAL)
  replies.write(b"ready\n")
  for line in sys.stdin.buffer:
    try:
      verdict = _check_equivalence(*json.loads(line))
    except Exception:  # model output may break sympy in any way; it just scores wrong
      verdict = ERROR
    replies.write(verdict.encode() + b"\n")


# ----------------------------------------------------------------------------- Worker pool

# Loads this file without importing the `rl` package, whose __init__ files may pull in JAX.
_WORKER_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_math_reward_worker', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "sys.modules[spec.name] = module\n"
    "spec.loader.exec_module(module)\n"
    "module._worker_main(int(sys.argv[2]))\n")


class _Worker:
  """One worker process, its pipes, and the request it is serving."""

  def __init__(self, memory_mb: int):
    self.process = subprocess.Popen(
        [sys.executable, "-c", _WORKER_BOOTSTRAP, os.path.abspath(__file__), str(memory_mb)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    self.unread = b""
    self.ready = False
    self.request_index: int | None = None
    self.deadline = time.monotonic() + _WORKER_START_TIMEOUT_S

  def fileno(self) -> int:
    return self.process.stdout.fileno()

  def send(self, gold: str, answer: str) -> bool:
    """Sends one request; False when the worker has died."""
    try:
      self.process.stdin.write(json.dumps([gold, answer]).encode() + b"\n")
      return True
    except (BrokenPipeError, OSError):
      return False

  def read_line(self) -> str | None:
    """The next reply line (call when readable): "" while incomplete, None on EOF."""
    chunk = os.read(self.fileno(), 4096)
    if not chunk:
      return None
    self.unread += chunk
    if b"\n" not in self.unread:
      return ""
    line, self.unread = self.unread.split(b"\n", 1)
    return line.decode()

  def stop(self) -> None:
    self.process.kill()
    self.process.wait()
    self.process.stdin.close()
    self.process.stdout.close()


class VerifierPool:
  """Long-lived math-verify worker processes with a hard deadline on every request.

  One request is in flight per worker, so a deadline is exactly one call's wall-clock time; a
  worker that overruns is killed and a fresh one starts in the background (~0.5 s of CPU).
  """

  def __init__(self, num_workers: int = 2, *, memory_mb: int = DEFAULT_WORKER_MEMORY_MB):
    if num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    self._memory_mb = memory_mb
    self._workers = [_Worker(memory_mb) for _ in range(num_workers)]

  def grow(self, num_workers: int) -> None:
    while len(self._workers) < num_workers:
      self._workers.append(_Worker(self._memory_mb))

  def _replace(self, worker: _Worker) -> None:
    worker.stop()
    self._workers[self._workers.index(worker)] = _Worker(self._memory_mb)

  def _fail(self, worker: _Worker, verdicts: list, verdict: str) -> None:
    if not worker.ready:
      raise RuntimeError(f"a math-verify worker failed to start (exit code "
                         f"{worker.process.poll()}); is math-verify installed?")
    verdicts[worker.request_index] = verdict
    self._replace(worker)

  def check(self, pairs: Sequence[tuple[str, str]], timeout_s: float) -> list[str]:
    """Verdicts for (gold, answer) pairs: correct / wrong / unparsed / guarded / timeout / error."""
    verdicts: list[str | None] = [None] * len(pairs)
    pending = collections.deque(range(len(pairs)))
    while pending or any(w.request_index is not None for w in self._workers):
      for worker in list(self._workers):
        if worker.ready and worker.request_index is None and pending:
          worker.request_index = pending.popleft()
          worker.deadline = time.monotonic() + timeout_s
          if not worker.send(*pairs[worker.request_index]):
            self._fail(worker, verdicts, ERROR)
      waiting = [w for w in self._workers if w.request_index is not None or not w.ready]
      wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
      for worker in multiprocessing.connection.wait(waiting, wait_s):
        line = worker.read_line()
        if line is None:
          self._fail(worker, verdicts, ERROR)  # died mid-request (e.g. out of memory)
        elif line and not worker.ready:
          worker.ready = True
        elif line:
          verdicts[worker.request_index] = line
          worker.request_index = None
      now = time.monotonic()
      for worker in [w for w in self._workers if w.deadline < now]:
        if not worker.ready:
          raise RuntimeError(f"a math-verify worker did not start in {_WORKER_START_TIMEOUT_S} s")
        if worker.request_index is not None:
          self._fail(worker, verdicts, TIMEOUT)
    return verdicts

  def close(self) -> None:
    for worker in self._workers:
      worker.stop()
    self._workers = []
