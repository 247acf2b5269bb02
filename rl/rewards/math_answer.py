"""Math answers as strings: normalisation, and the answer rules that settle a comparison without
sympy. The math reward (math.py) sends to math-verify only what these rules leave open.

Normalise (`normalize_answer`): drop `$`, `\\$`, `\\%`, degrees, trailing unit text and unit
words, `\\left` / `\\right`, LaTeX spacing, a trailing period; `\\dfrac` / `\\tfrac` -> `\\frac`;
1,000 -> 1000 only when the whole answer is one such number (so (1,2) and 1,-2 keep their
commas); AIME's zero padding (025 -> 25); .5 -> 0.5.

Answer rules (one rule each, the same on every path of the reward, mode="dapo" included):
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
"""

from __future__ import annotations

import fractions
import re

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


def rule_verdict(answer: str, gold: str) -> tuple[str | None, str, str]:
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
