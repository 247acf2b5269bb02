"""Thinking context management across tool calls (DeepSeek-V3.2's rule).

Reasoning (`<think>...</think>`) written in an assistant turn stays in the context while tool
results come back, so the model keeps its chain of thought across the calls of one task; it is
dropped only once a new user message arrives (every assistant turn before the latest user
message loses its reasoning). Tool calls and tool results are always kept.

The rule is given twice, over chat messages (`visible_messages`, used to render transcripts) and
over the token segments of a rollout episode (`visible_ids`, used for the context each engine
round continues), so sampled tokens are never re-tokenised.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from models.tokenizer import THINK_END, THINK_START

USER_ROLES = ("prompt", "user")  # "prompt": the opening system + user turns of an episode
_REASONING = re.compile(re.escape(THINK_START) + ".*?" + re.escape(THINK_END) + r"\s*",
                        re.DOTALL)


@dataclasses.dataclass
class Segment:
  """A run of tokens of one role in an episode; only "assistant" segments are sampled."""
  role: str  # "prompt", "user", "assistant" or "tool"
  ids: list[int]
  logp: list[float] = dataclasses.field(default_factory=list)  # per id, assistant only


def strip_reasoning(text: str) -> str:
  """`text` without its closed `<think>...</think>` spans (and the whitespace after them)."""
  return _REASONING.sub("", text)


def visible_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The messages the model sees: reasoning kept after the latest user message, dropped from
  assistant messages before it; tool calls and tool messages untouched."""
  last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
  out = []
  for i, message in enumerate(messages):
    message = dict(message)
    if message["role"] == "assistant" and i < last_user:
      message["content"] = strip_reasoning(message["content"])
    out.append(message)
  return out


def strip_reasoning_ids(ids: Sequence[int], think_start_id: int, think_end_id: int) -> list[int]:
  """Token version of `strip_reasoning` for tokenizers with single-id think markers; an
  unclosed `<think>` (a turn cut off mid-thought) is kept."""
  out: list[int] = []
  open_at = None
  for token in ids:
    if token == think_start_id and open_at is None:
      open_at = len(out)
    out.append(token)
    if token == think_end_id and open_at is not None:
      del out[open_at:]
      open_at = None
  return out


def visible_ids(segments: Sequence[Segment], tokenizer) -> list[int]:
  """The context an episode continues from: its segments in order, with reasoning dropped
  from assistant segments that precede the latest user segment."""
  last_user = max((i for i, s in enumerate(segments) if s.role in USER_ROLES), default=-1)
  start_id, end_id = tokenizer.token_to_id(THINK_START), tokenizer.token_to_id(THINK_END)
  out: list[int] = []
  for i, segment in enumerate(segments):
    if segment.role != "assistant" or i > last_user:
      out += segment.ids
    elif start_id is not None and end_id is not None:
      out += strip_reasoning_ids(segment.ids, start_id, end_id)
    else:
      out += tokenizer.encode(strip_reasoning(tokenizer.decode(segment.ids, skip_special=False)))
  return out
