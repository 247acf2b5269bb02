"""Tests for the rule-based math reward (rl/rewards/math.py) on the pinned evaluation sets.

Every gold answer of MATH-500 (all 500), AIME 2024, AIME 2025, AMC 2023 and the first 200 of
GSM8K is written into responses three ways (boxed, `Answer:` line, "the answer is .." at the end
of a paragraph) and must score right; numeric golds also as a bare number closing a paragraph.
Perturbed answers (off by one, wrong sign, wrong interval end) must score wrong. Scoring goes
through `score_batch` with 2 workers; most right answers take the exact-match fast path.
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import bench_math_reward
from rl import data
from rl.rewards import extract
from rl.rewards import math as math_reward
from rl.rewards import math_answer

EVAL_DIR = Path(data.EVAL_DIR)
REPO_ROOT = Path(__file__).resolve().parents[3]
GSM8K_ROWS = 200
TIMEOUT_S = 5.0

# The pinned sets are in rl/data/eval (or wherever $SEEDRL_EVAL_DIR points); if that folder is
# missing only the data-driven tests are skipped, with this reason shown.
needs_eval_sets = pytest.mark.skipif(not EVAL_DIR.is_dir(), reason=f"no eval sets at {EVAL_DIR}")


def _read_jsonl(name: str) -> list[dict]:
  with open(EVAL_DIR / name) as file:
    return [json.loads(line) for line in file]


def _golds(dataset: str) -> list[str]:
  if dataset == "math500":
    return [row["answer"] for row in _read_jsonl("math500_test.jsonl")]
  if dataset == "gsm8k":
    rows = _read_jsonl("gsm8k_test.jsonl")[:GSM8K_ROWS]
    return [row["answer"].split("#### ")[-1].strip() for row in rows]
  return [str(row["answer"]) for row in _read_jsonl(f"{dataset}_test.jsonl")]


DATASETS = ("math500", "aime24", "aime25", "amc23", "gsm8k")


def _score_all(responses, golds, **kwargs):
  return math_reward.score_batch(responses, golds, timeout_s=TIMEOUT_S, num_workers=2, **kwargs)


# ----------------------------------------------------------------------------- Response forms

def _boxed_response(gold: str) -> str:
  return f"We simplify step by step.\n\nSo the final result is $\\boxed{{{gold}}}$."


def _answer_line_response(gold: str) -> str:
  return f"We simplify step by step and check the result.\nAnswer: {gold}"


def _answer_phrase_response(gold: str) -> str:
  return f"We simplify step by step.\n\nPutting the pieces together, the answer is {gold}."


def _bare_number_response(gold: str) -> str:
  return f"We add the two parts.\n\nAdding them gives {gold}.\n"


_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def _is_plain_number(gold: str) -> bool:
  """The bare-number form applies to golds written as a plain decimal number; others (LaTeX,
  tuples, text, units) have no "last number" to extract, so a bare paragraph cannot state them."""
  return bool(_PLAIN_NUMBER.fullmatch(gold.strip()))


@needs_eval_sets
@pytest.mark.parametrize("dataset", DATASETS)
def test_gold_answers_in_every_form_score_correct(dataset, capsys):
  """Each gold scores 1.0 boxed, on an `Answer:` line and after "the answer is"; plain-number
  golds also as the last number of a paragraph (the other golds are counted and reported)."""
  golds = _golds(dataset)
  bare = [gold for gold in golds if _is_plain_number(gold)]
  forms = {
      "boxed": [_boxed_response(gold) for gold in golds],
      "answer_line": [_answer_line_response(gold) for gold in golds],
      "answer_phrase": [_answer_phrase_response(gold) for gold in golds],
      "bare_number": [_bare_number_response(gold) for gold in bare],
  }
  with capsys.disabled():
    print(f"\n{dataset}: {len(golds)} golds x 3 forms; bare-number form for {len(bare)}, "
          f"not applicable to {len(golds) - len(bare)} (not plain numbers)", end="")
  for form, responses in forms.items():
    form_golds = bare if form == "bare_number" else golds
    scores, counts = _score_all(responses, form_golds)
    failures = [(gold, response) for gold, response, s in zip(form_golds, responses, scores)
                if s != 1.0]
    assert not failures, f"{dataset}/{form}: {len(failures)} wrong, e.g. {failures[:3]}; {counts}"
    assert counts.timeouts == 0 and counts.errors == 0, counts


# ----------------------------------------------------------------------------- Perturbations

def _digit_runs(text: str) -> list[re.Match]:
  """Digit runs that are values, not subscripts (a base such as 52_8 or 4210_{5})."""
  return [m for m in re.finditer(r"\d+", text) if not re.search(r"_\{?$", text[:m.start()])]


def _off_by_one(gold: str) -> str | None:
  runs = _digit_runs(gold)
  if not runs:
    return None
  run = runs[0]
  bumped = str(int(run.group()) + 1).zfill(len(run.group()))
  return gold[:run.start()] + bumped + gold[run.end():]


def _wrong_sign(gold: str) -> str | None:
  """Drops a leading minus, else negates a simple expression, else (tuples, sets, intervals,
  equations, matrices) flips the sign of the first non-zero number. None for text and zero."""
  if gold.startswith("-"):
    return gold[1:]
  if re.search(r"\\text|\\mbox", gold) or re.fullmatch(r"0+(\.0+)?", gold):
    return None
  compound = (re.search(r"[,=]|\\in\b|\\begin", gold)
              or gold.startswith(("(", "[", "\\{", "\\left")))
  if not compound:
    return "-" + gold
  runs = [run for run in _digit_runs(gold) if int(run.group()) != 0]
  if not runs:
    return None
  run = runs[0]
  if gold[:run.start()].endswith("-"):
    return gold[:run.start() - 1] + gold[run.start():]
  return gold[:run.start()] + "-" + gold[run.start():]


def _wrong_interval_end(gold: str) -> str | None:
  """Flips the bracket of a finite endpoint of an unambiguous interval answer (one that uses
  \\infty, \\cup or a square bracket; "(a,b)" alone may be an ordered pair)."""
  normalized = math_answer.normalize_answer(gold)
  if not re.search(r"\\infty|\\cup|\[|\]", normalized):
    return None
  flip = {"(": "[", "[": "(", ")": "]", "]": ")"}
  closing = [i for i, c in enumerate(normalized)
             if c in ")]" and not normalized[:i].rstrip().endswith("\\infty")]
  opening = [i for i, c in enumerate(normalized)
             if c in "([" and not normalized[i + 1:].lstrip().startswith(("-\\infty", "\\infty"))]
  if closing:
    index = closing[-1]
  elif opening:
    index = opening[0]
  else:
    return None
  return normalized[:index] + flip[normalized[index]] + normalized[index + 1:]


PERTURBATIONS = {"off_by_one": _off_by_one, "wrong_sign": _wrong_sign,
                 "interval_end": _wrong_interval_end}


@needs_eval_sets
@pytest.mark.parametrize("dataset", DATASETS)
def test_perturbed_answers_score_wrong(dataset, capsys):
  """Off-by-one, sign-flipped and interval-end-flipped golds score 0.0 (boxed responses); golds
  a perturbation does not apply to (no number, zero, text) are counted and reported."""
  golds = _golds(dataset)
  applied = {}
  for name, perturb in PERTURBATIONS.items():
    pairs = [(gold, perturb(gold)) for gold in golds]
    pairs = [(gold, wrong) for gold, wrong in pairs if wrong is not None]
    applied[name] = len(pairs)
    if not pairs:
      continue
    scores, counts = _score_all([_boxed_response(wrong) for _, wrong in pairs],
                                [gold for gold, _ in pairs])
    accepted = [pair for pair, s in zip(pairs, scores) if s != 0.0]
    assert not accepted, f"{dataset}/{name}: accepted {accepted[:5]}; {counts}"
    assert counts.timeouts == 0, counts
  with capsys.disabled():
    print(f"\n{dataset}: perturbations applied (of {len(golds)} golds): {applied}", end="")


# ----------------------------------------------------------------------------- Equivalences

def _aime25_row_19() -> dict:
  return next(row for row in _read_jsonl("aime25_test.jsonl") if str(row["id"]) == "19")


EQUIVALENT = [
    ("524288", "2^{19}"), ("2^{19}", "524288"), ("\\frac12", "0.5"), ("0.5", "\\frac{1}{2}"),
    ("025", "25"), ("25", "025"), ("1000", "1,000"), ("58,500", "58500"), ("10,\\!080", "10080"),
    ("\\dfrac{17}{50}", "\\frac{17}{50}"), ("\\dfrac{17}{50}", "0.34"), ("\\$18.90", "18.9"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})"),
    ("\\frac{270}7\\text{ degrees}", "\\frac{270}{7}"), ("x \\in [-2,7]", "[-2, 7]"),
    ("1 \\pm \\sqrt{19}", "1+\\sqrt{19}, 1-\\sqrt{19}"), ("\\text{(B)}", "B"),
    ("\\text{Evelyn}", "Evelyn"), ("2\\sqrt{2}", "\\sqrt{8}"),
    ("\\frac{\\sqrt{3}}{3}", "\\frac{1}{\\sqrt{3}}"), ("x^3+3x-6", "3x + x^3 - 6"),
    ("\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}",
     "\\begin{pmatrix} \\frac15 \\\\ -\\frac{18}{5} \\end{pmatrix}"),
    ("\\frac{1}{2^{99}}", "2^{-99}"), ("5.4 \\text{ cents}", "5.4"), (".35625", "0.35625"),
    ("864 \\mbox{ inches}^2", "864"), ("90^\\circ", "90 degrees"), ("27.0", "27"),
    ("x=5", "5"), ("y = 2x + 3", "y = 3 + 2x"), ("x = \\frac{1}{2^{99}}", "x = 2^{-99}"),
    ("5x - 7y + 11z + 4 = 0", "-5x + 7y - 11z - 4 = 0"),
]


@needs_eval_sets
def test_equivalent_forms_score_correct():
  """Different writings of the same value score 1.0, in boxed and `Answer:` responses."""
  row = _aime25_row_19()
  assert row["answer"] == "336^\\circ"
  pairs = EQUIVALENT + [(row["answer"], "336"), (row["answer"], "336^{\\circ}")]
  responses = [_boxed_response(a) for _, a in pairs] + [_answer_line_response(a) for _, a in pairs]
  golds = [g for g, _ in pairs] * 2
  scores, counts = _score_all(responses, golds)
  failures = [(g, r) for g, r, s in zip(golds, responses, scores) if s != 1.0]
  assert not failures, f"{failures}; {counts}"
  assert counts.verified_correct > 0  # the non-trivial ones did go through math-verify


# ----------------------------------------------------------------------------- False positives

TINY_DIFFERENCES = [
    ("\\frac{1}{2^{99}}", "\\frac{1}{2^{98}}"), ("\\frac{1}{2^{98}}", "\\frac{1}{2^{99}}"),
    ("2^{-99}", "0"), ("1 + 2^{-60}", "1"), ("\\frac{1}{2^{98}}", "1.5777218104420236e-30"),
    ("(\\frac{1}{2^{99}}, 1)", "(\\frac{1}{2^{98}}, 1)"), ("0.0000672", "0.000067"),
    ("\\{2^{-99}, 1\\}", "\\{2^{-98}, 1\\}"), ("x = \\frac{1}{2^{99}}", "x = \\frac{1}{2^{98}}"),
    ("x = \\frac{1}{2^{99}}", "\\frac{1}{2^{98}}"),
]
PARTIAL_PARSES = [
    ("1-\\frac{1}{e}", "\\boxed{1+\\frac{1}{e}}"), ("1+\\frac{1}{e}", "\\boxed{1-\\frac{1}{e}}"),
    ("1-1/e", "So the answer is 1+1/e."), ("1", "So the answer is 1-1/e."),
    ("1", "Answer: 1 - 1/e"), ("2", "\\boxed{2^{-99}}"), ("7", "Answer: 3, 5, 7"),
    ("0.5", "\\boxed{0.5^{99}}"),
]


def test_tiny_numeric_differences_score_wrong():
  """Distinct exact values that math-verify's 6-decimal rounding would call equal score 0.0
  (also inside tuples and sets, and against a float written in scientific notation)."""
  scores, counts = _score_all([_boxed_response(a) for _, a in TINY_DIFFERENCES],
                              [g for g, _ in TINY_DIFFERENCES])
  assert scores == [0.0] * len(TINY_DIFFERENCES), (scores, counts)
  assert counts.guarded > 0  # the guard, not just math-verify, rejected some of them


def test_partial_parses_score_wrong():
  """An answer whose parse would keep only a piece of it (plain "1-1/e" reads as "1") or
  differs from the gold by one operator scores 0.0."""
  scores, counts = _score_all([r for _, r in PARTIAL_PARSES], [g for g, _ in PARTIAL_PARSES])
  assert scores == [0.0] * len(PARTIAL_PARSES), (scores, counts)


def test_truncated_answer_counts_as_unparsed():
  """A malformed answer (unclosed brace, which math-verify would read as "1") is unparsed: it
  scores 0.0 without a judge and is counted as such."""
  scores, counts = _score_all(["Answer: 1/2^{99"], ["1"])
  assert scores == [0.0] and counts.unparsed == 1, counts


# ----------------------------------------------------------------------------- Timeouts

@pytest.mark.parametrize("response", ["\\boxed{9^9^9^9^9}", "\\boxed{10^{10^{10^{10}}}}",
                                      "Answer: 9^{9^{9^{9^{9}}}}", "\\boxed{9^{9^{9}}}"])
def test_pathological_answers_return_within_timeout_as_wrong(response):
  """A power tower scores 0.0 within the per-call timeout (the worker is killed or fails fast
  on its memory limit), and the pool keeps working afterwards."""
  timeout_s = 2.0
  start = time.monotonic()
  scores, counts = math_reward.score_batch([response], ["5"], timeout_s=timeout_s, num_workers=2)
  elapsed = time.monotonic() - start
  assert scores == [0.0], counts
  assert elapsed < timeout_s + 1.0, f"took {elapsed:.1f} s"
  assert math_reward.score("\\boxed{2^{3}}", "8", timeout_s=TIMEOUT_S) == 1.0


def test_timeouts_are_counted():
  """An overrunning call (9^387420489 is minutes of big-integer work within the memory limit)
  is reported as a timeout and scores 0.0."""
  scores, counts = math_reward.score_batch(["\\boxed{9^{9^{9}}}"], ["5"], timeout_s=1.0)
  assert scores == [0.0] and counts.timeouts == 1, counts
  assert math_reward.path_counts().timeouts >= 1


# ----------------------------------------------------------------------------- Modes, judge

def test_dapo_mode_is_strict_string_match():
  """mode="dapo": +1 only when the last `Answer:` line normalises to the normalised gold."""
  cases = [("Answer: 25", "025", 1.0), ("Answer: 1,000", "1000", 1.0),
           ("Answer: 336^\\circ", "336", 1.0), ("Answer: 24", "025", -1.0),
           ("\\boxed{25}", "25", -1.0), ("Answer: 0.5", "\\frac{1}{2}", -1.0),
           ("Answer: 7\nAnswer: 8", "8", 1.0)]
  scores, counts = math_reward.score_batch([r for r, _, _ in cases], [g for _, g, _ in cases],
                                           mode="dapo")
  assert scores == [expected for _, _, expected in cases]
  assert counts.dapo_match == 4 and counts.dapo_mismatch == 3


def test_judge_is_called_only_when_rules_cannot_settle():
  """The judge decides (its value clipped to [0, 1] is the reward) only for unparsable answers,
  all of a batch in one call; exact matches and math-verify verdicts never reach it."""
  calls = []

  def judge(questions, references, answers):
    calls.extend(zip(questions, references, answers))
    return [0.75] * len(answers)

  responses = ["Answer: \\frac{1}{2", "\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", "\\boxed{3}"]
  golds = ["\\frac{1}{2}"] * 4
  questions = ["What is one half?"] * 4
  scores, counts = _score_all(responses, golds, judge=judge, questions=questions)
  assert scores == [0.75, 1.0, 1.0, 0.0]
  assert calls == [("What is one half?", "\\frac{1}{2}", "\\frac{1}{2")]
  assert counts.judged == 1 and counts.unparsed == 0
  truncated = "Answer: \\frac{1}{2"
  assert math_reward.score(truncated, "\\frac{1}{2}", judge=lambda q, r, a: [3.0] * len(a)) == 1.0  # clipped
  assert math_reward.is_correct(truncated, "\\frac{1}{2}", judge=lambda q, r, a: [0.2] * len(a)) is False


def test_no_answer_scores_wrong():
  """A response with no box, no Answer line, no answer phrase and no number scores 0.0."""
  scores, counts = _score_all(["I am not sure how to proceed."], ["5"])
  assert scores == [0.0] and counts.no_answer == 1


# ----------------------------------------------------------------------------- Extraction

@pytest.mark.parametrize("response, expected", [
    ("so $\\boxed{\\frac{1}{2}}$ and then \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),
    ("\\fbox{7}", "7"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
    ("first \\boxed{3} then \\boxed{\\frac{1}{", "3"),  # truncated last box: use the earlier one
    ("\\boxed 5$.", "5"),
    ("Answer: 4\nmore text\nAnswer: $\\frac{1}{2}$", "$\\frac{1}{2}$"),
    ("Thus the final answer is 3.21. I hope it is correct.", "3.21"),
    ("**Answer:** 42", "42"),
    ("So the final answer is **17**.", "17"),
    ("We get 12 apples and 1,250 pears", "1,250"),
    ("x-3 equals", "3"),
    ("no digits here", None),
])
def test_math_answer(response, expected):
  """Extraction order: last complete box, last Answer line, answer phrase, last number."""
  assert extract.math_answer(response) == expected


@pytest.mark.parametrize("raw, expected", [
    ("\\$1,000.", "1000"), ("(1,2)", "(1,2)"), ("1,-2", "1,-2"), ("025", "25"),
    ("\\dfrac{3}{4}", "\\frac{3}{4}"), ("\\tfrac12", "\\frac{1}{2}"), ("336^\\circ", "336"),
    ("90 degrees", "90"), ("50\\%", "50"), ("\\left( 3, 4 \\right]", "( 3, 4 ]"),
    ("15\\mbox{ cm}^2", "15"), ("\\text{Evelyn}", "Evelyn"), ("\\text{(C)}", "C"),
    ("11,\\! 111,\\! 100", "11111100"), ("1\\,000", "1000"), (".5", "0.5"), ("10.05", "10.05"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ("2.5e-3", "2.5\\times 10^{-3}"), ("3, 5, 7", "3, 5, 7"),
])
def test_normalize_answer(raw, expected):
  """Units, text, separators, leading zeros and LaTeX variants normalise as documented."""
  assert math_answer.normalize_answer(raw) == expected


# ----------------------------------------------------------------------------- Isolation, speed

def test_caller_process_never_loads_sympy():
  """Scoring (including the math-verify path) leaves sympy and math-verify out of the caller's
  process: all parsing of model output happens in the workers."""
  script = ("import sys\n"
            "from rl.rewards import math as m\n"
            "responses = ['\\\\boxed{2^{19}}', '\\\\boxed{7}']\n"
            "scores, counts = m.score_batch(responses, ['524288', '8'])\n"
            "assert scores == [1.0, 0.0], scores\n"
            "assert 'sympy' not in sys.modules and 'math_verify' not in sys.modules\n")
  subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, check=True, timeout=120)


@needs_eval_sets
def test_score_batch_throughput(capsys):
  """score_batch scores 500 MATH-500 answers without timeouts; prints answers/s for reference
  solutions (exact-match path), off-by-one answers, and the math-verify-only subset (the same
  report as `python launch/bench_math_reward.py`)."""
  lines = bench_math_reward.run_benchmark(str(EVAL_DIR), num_workers=2, timeout_s=TIMEOUT_S)
  with capsys.disabled():
    print("\n" + "\n".join(lines))
  assert len(lines) == 3 and all("timeouts=0" in line for line in lines)


# ----------------------------------------------------------------------------- Answer rules

ANSWER_RULES = [  # (gold, answer, score): the module docstring's decimal, unit and zero rules
    ("\\frac{1}{3}", "0.333333", 0.0), ("\\pi", "3.14159", 0.0), ("\\pi", "3.141593", 0.0),
    ("0.333333", "\\frac{1}{3}", 0.0), ("3.14", "\\pi", 0.0), ("3.14", "\\frac{157}{50}", 1.0),
    ("\\frac{1}{8}", "0.125", 1.0), ("(\\frac{1}{2}, 3)", "(0.5, 3)", 1.0),
    ("(\\frac{1}{3}, 3)", "(0.333333, 3)", 0.0),
    ("5\\text{ cm}", "5 \\text{ m}", 0.0), ("5\\text{ cm}", "5 cm", 1.0),
    ("5\\text{ cm}", "5", 1.0), ("5", "5\\text{ cm}", 1.0), ("5\\text{ cm}^2", "5 cm^{2}", 1.0),
    ("5\\text{ cm}^2", "5 cm", 0.0), ("\\frac{1}{2}\\text{ m}", "0.5\\text{ m}", 1.0),
    ("110", "0110", 0.0), ("0110", "110", 0.0), ("0110", "0110", 1.0), ("25", "025", 1.0),
    ("007", "7", 1.0), ("(1, 10)", "(1, 010)", 0.0),
]


def test_answer_rules_one_per_inconsistency():
  """Decimals are exact (1/3 and pi both reject their 6-digit decimals), units must agree when
  both sides have one, and leading zeros are significant except AIME's padding."""
  scores, counts = _score_all([_boxed_response(a) for _, a, _ in ANSWER_RULES],
                              [g for g, _, _ in ANSWER_RULES])
  wrong = [(g, a, want, got) for (g, a, want), got in zip(ANSWER_RULES, scores) if got != want]
  assert not wrong, (wrong, counts)
  assert counts.unit_mismatch == 2 and counts.digits_mismatch == 3, counts


def test_answer_rules_hold_in_dapo_mode():
  """mode="dapo" applies the same unit and leading-zero rules."""
  cases = [("Answer: 5 \\text{ m}", "5\\text{ cm}", -1.0), ("Answer: 5 cm", "5\\text{ cm}", 1.0),
           ("Answer: 0110", "110", -1.0), ("Answer: 025", "25", 1.0)]
  scores, _ = math_reward.score_batch([r for r, _, _ in cases], [g for _, g, _ in cases],
                                      mode="dapo")
  assert scores == [want for _, _, want in cases]


def test_response_over_the_cap_is_not_read():
  """A response over MAX_RESPONSE_CHARS scores wrong, counted, whatever it ends with."""
  response = "x" * math_reward.MAX_RESPONSE_CHARS + "\\boxed{5}"
  scores, counts = math_reward.score_batch([response], ["5"])
  assert scores == [0.0] and counts.response_too_long == 1
  dapo_response = "x" * math_reward.MAX_RESPONSE_CHARS + "\nAnswer: 5"
  scores, counts = math_reward.score_batch([dapo_response], ["5"], mode="dapo")
  assert scores == [-1.0] and counts.response_too_long == 1
