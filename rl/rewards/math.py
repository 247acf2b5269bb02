"""Rule-based math rewards: extract a response's final answer and grade it against the gold.

Pipeline for one (response, gold) pair, all string work in the caller's process:

1. Extract (`extract.math_answer`): the last complete `\\boxed{..}` / `\\fbox{..}` (balanced braces),
   else the last `Answer: ..` line (DAPO's format), else the rest of the last "the answer is .."
   sentence, else the last number in the text. No answer at all scores wrong.
2. Normalise (`normalize_answer`): drop `$`, `\\$`, `\\%`, degrees, trailing unit text and unit
   words, `\\left` / `\\right`, LaTeX spacing, a trailing period; `\\dfrac` / `\\tfrac` -> `\\frac`;
   1,000 -> 1000 only when the whole answer is one such number (so (1,2) and 1,-2 keep their
   commas); AIME's zero padding (025 -> 25); .5 -> 0.5.
3. Compare, by the answer rules below: equal normalised strings score right at once; two plain
   decimal literals are compared exactly as fractions; everything else goes to math-verify in a
   worker process.

Answer rules (one rule each, the same on every path, mode="dapo" included):
* Decimals are the exact values they write. 0.5 = 1/2 and 0.125 = 1/8, but 0.333333 != 1/3
  and 3.14159 != pi; a decimal gold 3.14 is matched by 3.14, 3.140 or 157/50, not by pi.
  Answers that must be rounded are graded against a gold written rounded the same way.
* Units: a trailing unit (a `\\text{..}` / `\\mbox{..}` group or a unit word such as cm,
  degrees, dollars, with its power) is ignored when only one side has one; when both do, they
  must be spelled the same (ignoring case, spaces and braces): 5 cm = 5\\text{ cm} = 5, but
  5\\text{ m} != 5\\text{ cm} and 5 cm != 5 centimeters.
* Leading zeros are significant, except AIME's three-digit padding of a whole answer (025 =
  25, 007 = 7): 0110 != 110 (a digit string or code), and an answer holding such a zero
  matches only the same string.

Bounded time. Extraction is linear in the response (every scan stops where an earlier one
started), responses over MAX_RESPONSE_CHARS score wrong unread (counted), answers over
MAX_ANSWER_CHARS too, and math-verify has a hard deadline per call: one response costs at most
about a second of the caller's CPU, whatever its text.

Workers. math-verify parses and compares with sympy, which can hang or exhaust memory on model
output (`9^9^9^9^9`), and its own timeouts use `signal.alarm`, which only works on a main thread.
So `verify(gold, answer)` (gold first: it is not symmetric) runs in long-lived worker processes
(plain subprocesses that load this file alone: no re-import of the caller's main module, no JAX).
Every call has a hard wall-clock deadline: a worker that overruns is killed and replaced and the
call scores wrong. Workers also run under an address-space limit, so a huge power fails with
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

Judge. Where the rules cannot settle (either side failed to parse), `judge(question, gold,
answer) -> [0, 1]` decides if given, else the answer scores wrong. `rl/rewards/genrm.py`
provides a Seed-Verifier-style judge built on our own models: `make_math_judge(rm)`. A judge
score is a probability, returned as the reward unchanged (clipped to [0, 1]).

Modes. "verify": 1.0 right, 0.0 wrong. "dapo": DAPO's strict rule, +1 when the text after the
last "Answer:" normalises to the normalised gold, else -1 (no math-verify, no judge).

Every call counts the path it took (`PathCounts`): `score_batch` returns the batch's counts and
`path_counts()` the totals since import.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import fractions
import functools
import json
import multiprocessing.connection
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from rl.rewards import extract

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_WORKER_MEMORY_MB = 2048
# Longer "answers" are not final answers; they would only cost normalisation and worker time.
MAX_ANSWER_CHARS = 1000
# Longer responses score wrong unread. Far above any generation length (a 128k-token response
# is ~0.5M characters), it bounds one response's grading: extraction is linear, about 0.1-0.3 s
# per million characters on one core, and math-verify runs under its own deadline.
MAX_RESPONSE_CHARS = 1 << 20
_WORKER_START_TIMEOUT_S = 120.0

Judge = Callable[[str, str, str], float]

# ----------------------------------------------------------------------------- Normalisation

_TEXT_COMMANDS = r"\\(?:text|textbf|textit|textnormal|mbox|mathrm|mathbf)"
_UNIT_WORDS = (
    "degrees?", "radians?", "units?", "cm", "mm", "km", "meters?", "metres?", "inch(?:es)?",
    "feet", "foot", "ft", "yards?", "miles?", "mph", "seconds?", "minutes?", "hours?", "days?",
    "weeks?", "months?", "years?", "dollars?", "cents?", "pounds?", "lbs?", "kg", "grams?",
    "liters?", "litres?", "ml", "percent", "sq", "square", "cubic", "people", "students",
    "times")
_TRAILING_UNIT_TEXT = re.compile(
    r"^(.*?\S)\s*(" + _TEXT_COMMANDS + r"\{[^{}]*\}\s*(?:\^\s*\{?\s*\d\s*\}?)?)$")
_TRAILING_UNIT_WORD = re.compile(
    r"^(.*?[\d}])\s+((?:(?:" + "|".join(_UNIT_WORDS) + r")\s*)+(?:\^\s*\{?\s*\d\s*\}?)?)$",
    re.IGNORECASE)
# Spelling of a stripped unit for comparison: "\text{ cm}^{2}" and "cm^2" are both "cm2".
_UNIT_NOISE = re.compile(_TEXT_COMMANDS + r"|[\s{}^]|\\[,;:! ]")
# A zero before a digit that is not part of a decimal: 0110, (01, 2); not 0.5 or 10.05.
_LEADING_ZERO = re.compile(r"(?<![\d.])0\d")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL_LITERAL = re.compile(r"-?\d+(?:\.\d+)?")
_SCIENTIFIC = re.compile(r"(-?\d+(?:\.\d+)?)[eE]([+-]?\d+)")


def normalize_answer(answer: str) -> str:
  """A canonical string for an extracted answer (see the module docstring for the rules)."""
  return _normalize_with_unit(answer)[0]


def _normalize_with_unit(answer: str) -> tuple[str, str]:
  """(normalize_answer(answer), the trailing unit it dropped in comparable spelling or "")."""
  text = answer.strip()
  text = text.replace("\\$", "").replace("$", "")
  text = re.sub(r"\\[()\[\]]", "", text)  # \( \) \[ \] math delimiters
  text = re.sub(r"\\(?:displaystyle|textstyle)(?![a-zA-Z])", "", text)
  text = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", text)
  text = re.sub(r"\\(?:left|right)(?:\.|(?![a-zA-Z]))", "", text)
  # ",\!" and "\," between digit groups are LaTeX thousands separators, unambiguous anywhere.
  text = re.sub(r"(\d)(?:,\s*\\!|\\,)\s*(?=\d{3}(?!\d))", r"\1", text)
  # LaTeX spacing becomes a space; the row break \\ (matrices) is matched first and kept.
  text = re.sub(r"\\\\|\\[!,;:> ]|\\q?quad(?![a-zA-Z])|~",
                lambda m: m.group(0) if m.group(0) == "\\\\" else " ", text)
  text = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])", "", text)
  text = text.replace("\\%", "").replace("%", "")
  text = text.strip().rstrip(".")  # a sentence's period, before units that end the answer
  whole_text = re.fullmatch(_TEXT_COMMANDS + r"\{([^{}]*)\}", text.strip())
  if whole_text:
    text = whole_text.group(1)
  units = []
  for unit_pattern in (_TRAILING_UNIT_TEXT, _TRAILING_UNIT_WORD):
    while match := unit_pattern.match(text.strip()):
      text, unit = match.groups()
      units.insert(0, unit)
  text = re.sub(r"\s+", " ", text).strip().rstrip(".").strip()
  if _THOUSANDS.fullmatch(text):
    text = text.replace(",", "")
  scientific = _SCIENTIFIC.fullmatch(text)
  if scientific:
    text = f"{scientific.group(1)}\\times 10^{{{scientific.group(2)}}}"
  if re.fullmatch(r"0\d\d", text):  # AIME's three-digit zero padding: 025 -> 25
    text = str(int(text))
  text = re.sub(r"(?<!\w)\.(?=\d)", "0.", text)  # .35 -> 0.35
  # Single-token arguments: \frac12 -> \frac{1}{2}, \sqrt2 -> \sqrt{2}.
  text = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", text)
  text = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", text)
  text = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", text)
  text = re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", text)
  choice = re.fullmatch(r"\(([A-Z])\)", text)
  if choice:
    text = choice.group(1)
  return text, _UNIT_NOISE.sub("", "".join(units)).lower()


def _comparison_key(normalized: str) -> str:
  """Whitespace-free form for the exact-match fast path; plain words compare caselessly."""
  key = re.sub(r"\s+", "", normalized)
  return key.lower() if re.fullmatch(r"[A-Za-z][A-Za-z ]+", normalized) else key


def _decimal_value(key: str) -> fractions.Fraction | None:
  if len(key) > 100 or not _DECIMAL_LITERAL.fullmatch(key):
    return None
  return fractions.Fraction(key)


def _rule_verdict(answer: str, gold: str) -> tuple[str | None, str, str]:
  """(verdict, normalised answer, normalised gold) from the string rules alone.

  verdict: "exact_match" (right), "literal" with "_right" / "_wrong" (two plain decimals,
  compared exactly), "unit_mismatch" / "digits_mismatch" (wrong by the answer rules of the
  module docstring), or None when math-verify must decide.
  """
  (answer_normalized, answer_unit), (gold_normalized, gold_unit) = (
      _normalize_with_unit(answer), _normalize_with_unit(gold))
  if answer_unit and gold_unit and answer_unit != gold_unit:
    return "unit_mismatch", answer_normalized, gold_normalized
  answer_key, gold_key = _comparison_key(answer_normalized), _comparison_key(gold_normalized)
  if answer_key == gold_key:
    return "exact_match", answer_normalized, gold_normalized
  if _LEADING_ZERO.search(answer_key) or _LEADING_ZERO.search(gold_key):
    return "digits_mismatch", answer_normalized, gold_normalized
  answer_value, gold_value = _decimal_value(answer_key), _decimal_value(gold_key)
  if answer_value is not None and gold_value is not None:
    verdict = "literal_right" if answer_value == gold_value else "literal_wrong"
    return verdict, answer_normalized, gold_normalized
  return None, answer_normalized, gold_normalized


# ----------------------------------------------------------------------------- Worker side

_CORRECT, _WRONG, _UNPARSED, _GUARDED = "correct", "wrong", "unparsed", "guarded"
_TIMEOUT, _ERROR = "timeout", "error"


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
    return _UNPARSED
  if not verify(gold_expression, answer_expression, timeout_seconds=None):
    return _WRONG
  if any(_numbers_differ(g, a) for g, a in _aligned_numbers(gold_expression, answer_expression)):
    return _GUARDED
  return _CORRECT


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
      verdict = _ERROR
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
            self._fail(worker, verdicts, _ERROR)
      waiting = [w for w in self._workers if w.request_index is not None or not w.ready]
      wait_s = max(0.0, min(w.deadline for w in waiting) - time.monotonic())
      for worker in multiprocessing.connection.wait(waiting, wait_s):
        line = worker.read_line()
        if line is None:
          self._fail(worker, verdicts, _ERROR)  # died mid-request (e.g. out of memory)
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
          self._fail(worker, verdicts, _TIMEOUT)
    return verdicts

  def close(self) -> None:
    for worker in self._workers:
      worker.stop()
    self._workers = []


_pool: VerifierPool | None = None
_pool_owner_pid: int | None = None
_pool_lock = threading.Lock()


def _shared_pool(num_workers: int) -> VerifierPool:
  """The process's pool, grown to `num_workers`. A forked child gets its own: the inherited
  pipes lead to its parent's workers."""
  global _pool, _pool_owner_pid
  if _pool is None or _pool_owner_pid != os.getpid():
    _pool, _pool_owner_pid = VerifierPool(num_workers), os.getpid()
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
               and _rule_verdict(answer, gold)[0] == "exact_match")
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
    judge: callable(question, gold, answer) -> [0, 1], used only when a side fails to parse.
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
    verdict, answer_normalized, gold_normalized = _rule_verdict(answer, gold)
    if verdict is not None:
      field = verdict.removesuffix("_right").removesuffix("_wrong")
      setattr(counts, field, getattr(counts, field) + 1)
      scores[index] = float(verdict in ("exact_match", "literal_right"))
      continue
    to_verify.setdefault((gold_normalized, answer_normalized), []).append(index)

  if to_verify:
    pairs = list(to_verify)
    with _pool_lock:
      verdicts = _shared_pool(num_workers).check(pairs, timeout_s)
    for pair, verdict in zip(pairs, verdicts):
      for index in to_verify[pair]:
        if verdict == _CORRECT:
          counts.verified_correct += 1
          scores[index] = 1.0
        elif verdict == _UNPARSED and judge is not None:
          counts.judged += 1
          question = questions[index] if questions is not None else ""
          scores[index] = min(1.0, max(0.0, float(judge(question, golds[index], answers[index]))))
        else:
          counts.verified_wrong += verdict == _WRONG
          counts.guarded += verdict == _GUARDED
          counts.unparsed += verdict == _UNPARSED
          counts.timeouts += verdict == _TIMEOUT
          counts.errors += verdict == _ERROR
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
