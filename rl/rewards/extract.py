"""Where a response states its answer: the one reader of each answer format, used by the
rewards (training) and by rl/jobs/evaluation.py and rl/jobs/select_prompts.py (evaluation, data selection).

Formats:

* `last_boxed`: the content of the last complete `\\boxed{..}` / `\\fbox{..}`.
* `answer_line`: the text after the last `Answer:` on its own line (DAPO's format, and the final
  line of a tool-use episode).
* `program_text`: the first fenced code block (```python ... ```), else the whole text.

The final answer of a response, per domain, composed from those readers:

* `math_answer`: boxed, else an `Answer:` line, else the rest of "the answer is .." sentence,
  else the last number.
* `puzzle_answer`: boxed, else everything after the last `Answer:` (a grid or a board spans
  several lines), else the whole response.

Every reader is linear in the length of the text (see `last_boxed` for the one with nesting).
"""

from __future__ import annotations

import re

# Puzzle responses are read only this far from their end: a verifier never looks at more.
PUZZLE_RESPONSE_CHARS = 100_000

_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")
# Runs of escaped characters (\\{ is no delimiter), of opening and of closing braces.
_GROUP_TOKEN = re.compile(r"(?:\\.)+|\{+|\}+", re.DOTALL)
_SPACES = re.compile(r"\s*")
_BARE_TOKEN = re.compile(r"[^\s$]*")
_ANSWER_MARKER = re.compile(r"answer\s*:", re.IGNORECASE)
_ANSWER_LINE = re.compile(_ANSWER_MARKER.pattern + r"[ \t]*([^\n]*)", re.IGNORECASE)
_ANSWER_PHRASE = re.compile(r"(?i)\bthe\s+(?:final\s+)?answer\s+is\s*:?[ \t]*([^\n]*)")
# A number not glued to a word or closing bracket on its left (so "x-3" gives 3, not -3).
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|(?:(?<![\w)\]}])-)?\.\d+")
# A fenced block: any language tag; an unterminated fence (a response cut at the length cap)
# runs to the end of the text.
_FENCED = re.compile(r"```[ \t]*[A-Za-z0-9_+.-]*[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def _group_end(text: str, open_index: int, limit: int) -> int | None:
  """Index of the `}` closing the group that opens at `open_index`, or None when it is not
  closed before `limit`. Escaped characters such as \\{ are not delimiters."""
  depth = 0
  for match in _GROUP_TOKEN.finditer(text, open_index, limit):
    run = match.group()
    if run[0] == "{":
      depth += len(run)
    elif run[0] == "}":
      if len(run) >= depth:
        return match.start() + depth - 1
      depth -= len(run)
  return None


def last_boxed(text: str) -> str | None:
  """Content of the last complete \\boxed / \\fbox (a truncated last one falls back to earlier),
  or None.

  `\\boxed {x}` and `\\boxed x` (one bare token) count; escaped braces (\\{) are no
  delimiters. Linear in len(text). A group that contains an unclosed one is unclosed too, so
  the scan for an earlier box's closing brace stops where the later unclosed box starts: no
  character is scanned twice. (Rescanning to the end for every unclosed box was quadratic:
  20,000 of them took minutes.)
  """
  limit = len(text)
  for command in reversed(list(_BOX_COMMAND.finditer(text))):
    start = _SPACES.match(text, command.end()).end()
    if text.startswith("{", start):
      close = _group_end(text, start, limit)
      if close is not None:
        return text[start + 1:close]
      limit = start
    elif command.end() < start < len(text):
      return _BARE_TOKEN.match(text, start).group()  # "\boxed 5": one bare token
  return None


def answer_line(text: str) -> str | None:
  """The text after the last `Answer:` (any case) to the end of its line, stripped, or None
  when there is none or it is empty. The answer must be on the marker's line: "Answer:" followed
  by a line break states nothing."""
  matches = [m.group(1).strip() for m in _ANSWER_LINE.finditer(text)]
  return matches[-1] if matches and matches[-1] else None


def program_text(response: str) -> str:
  """The program in a code response: its first fenced block (to the end of the text when the
  fence is never closed), else the whole text."""
  match = _FENCED.search(response)
  return match.group(1) if match else response


def _strip_decoration(answer: str) -> str:
  """Drops markdown bold and spaces around an answer and a sentence's period after it (a
  character loop: the equivalent regex is quadratic on a long run of spaces)."""
  start, end = 0, len(answer)
  while start < end and (answer[start].isspace() or answer[start] == "*"):
    start += 1
  while end > start and (answer[end - 1].isspace() or answer[end - 1] in "*."):
    end -= 1
  return answer[start:end]


def _answer_phrase(text: str) -> str | None:
  matches = [m.group(1) for m in _ANSWER_PHRASE.finditer(text)]
  if not matches:
    return None
  # The sentence ends at a period followed by space; decimals such as 3.21 have no space.
  answer = re.split(r"\.\s", matches[-1], maxsplit=1)[0].strip()
  return answer or None


def math_answer(response: str) -> str | None:
  """A math response's final answer (unnormalised), or None when it states none.

  Order: last complete \\boxed{}/\\fbox{}; last `Answer:` line; last "the (final) answer is X"
  (up to the end of that sentence); last number in the text. Markdown bold around a line or
  phrase answer is dropped (the math reward's mode="dapo" reads `answer_line` alone, which
  keeps it, as DAPO does).
  """
  for reader in (last_boxed, answer_line, _answer_phrase):
    answer = reader(response)
    if reader is not last_boxed and answer is not None:
      # Markdown bold ("**Answer:** 42", "the answer is **42**.") and a sentence's period.
      answer = _strip_decoration(answer)
    if answer:
      return answer
  numbers = _NUMBER.findall(response)
  return numbers[-1] if numbers else None


def puzzle_answer(response: str) -> str:
  """A puzzle response's final answer: within its last PUZZLE_RESPONSE_CHARS, the last
  `\\boxed{}`, else everything after the last "Answer:", else all of it; surrounding
  whitespace, `*` and backticks stripped."""
  text = response[-PUZZLE_RESPONSE_CHARS:]
  answer = last_boxed(text)
  if answer is None:
    markers = list(_ANSWER_MARKER.finditer(text))
    answer = text[markers[-1].end():] if markers else text
  return answer.strip().strip("*`").strip()
