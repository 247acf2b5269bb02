"""Tests for the answer-format readers (rl/rewards/extract.py), the one place each format is
parsed. The per-domain answers (`math_answer`, `puzzle_answer`) are tested with their rewards in
tests/rl/rewards/test_math_reward.py and tests/rl/rewards/test_puzzles.py."""

import re
from pathlib import Path

import pytest

from rl.rewards import extract

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("text, expected", [
    ("Answer: 4\nmore text\nAnswer: 7", "7"),
    ("answer: 7", "7"),  # any case
    ("if 3 > 2 then a -> b. Answer: 7", "7"),
    ("Answer: LIS1 POR2 H3  \n", "LIS1 POR2 H3"),
    ("Answer:\n7", None),  # the answer must be on the marker's line
    ("Answer: 7\nAnswer:   ", None),  # the last marker states nothing: no answer
    ("**Answer:** 42", "** 42"),  # DAPO's rule keeps markdown; math_answer drops it
    ("no marker", None),
])
def test_answer_line(text, expected):
  """The text after the last `Answer:` on its own line, stripped; None when that is empty. Math
  (mode="dapo" and the fallback after boxes) and tool-use episodes read answers this way."""
  assert extract.answer_line(text) == expected


@pytest.mark.parametrize("response, expected", [
    ("Here:\n```python\ndef f():\n  return 1\n```\nand ```py\nx = 2\n```", "def f():\n  return 1\n"),
    ("```\nprint(1)\n```", "print(1)\n"),
    ("```c++  \nint x;\n```", "int x;\n"),
    ("cut at the length cap:\n```python\nwhile True:\n  pass", "while True:\n  pass"),
    ("def f():\n  return 3\n", "def f():\n  return 3\n"),  # no fence: the whole text
    ("```python print(1)```", "```python print(1)```"),  # no line break after the tag: no block
])
def test_program_text(response, expected):
  """The first fenced block (any language tag, to the end of the text when never closed), else
  the whole response: what code rewards and HumanEval-in-chat both grade."""
  assert extract.program_text(response) == expected


@pytest.mark.parametrize("text, expected", [
    ("\\boxed{1} and \\boxed{\\frac{2}{3}}", "\\frac{2}{3}"),
    ("\\boxed{7} then an unclosed \\boxed{8", "7"),
    ("\\fbox{\\{1\\}}", "\\{1\\}"),
    ("\\boxed 5$.", "5"),
    ("\\boxedx{3}", None),
])
def test_last_boxed(text, expected):
  assert extract.last_boxed(text) == expected


def test_last_boxed_is_linear_in_unclosed_boxes():
  """20,000 unclosed boxes are read in one pass (rescanning to the end for each was quadratic)."""
  assert extract.last_boxed("\\boxed{1}" + "\\boxed{" * 20_000) == "1"


# Calls that parse an answer format: a regex naming a fence, a box or an `Answer:` marker.
_FORMAT_REGEX = re.compile(
    r"re\.(?:compile|search|match|fullmatch|findall|finditer|split|sub)\(\s*r?[\"'].*"
    r"(?:```|`\{3\}|boxed|fbox|[Aa]nswer\\s\*:|Answer:)")


def test_one_reader_per_answer_format():
  """No module outside rl/rewards/extract.py parses boxes, code fences or `Answer:` lines: the
  trainer, evaluation and the tool environments all read answers through extract.py."""
  assert (REPO_ROOT / "rl" / "rewards" / "extract.py").is_file(), REPO_ROOT  # scans the repo
  offenders = []
  for folder in ("rl", "launch", "models", "configs"):
    for path in sorted((REPO_ROOT / folder).rglob("*.py")):
      if path == REPO_ROOT / "rl" / "rewards" / "extract.py":
        continue
      for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FORMAT_REGEX.search(line):
          offenders.append(f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}")
  assert not offenders, "\n".join(offenders)
