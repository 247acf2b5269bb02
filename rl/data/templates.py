"""Prompt templates: how a record's `prompt` becomes the text (and token ids) the policy sees.

* "plain": the prompt as is.
* "dapo": DAPO-Math-17k's wording (Yu et al., 2025), which the strict `Answer:` reward expects.
* "think": reasoning inside <think>...</think>, then the final answer on an `Answer:` line.
* "chat": the prompt as one user turn under the tokenizer's chat template.

Non-chat templates encode with a leading bos (where the tokenizer has one), as the trainer's
plain prompts do; the chat template places its own special tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

TEMPLATES = ("plain", "dapo", "think", "chat")

DAPO_PREFIX = ("Solve the following math problem step by step. The last line of your response "
               "should be of the form Answer: $Answer (without quotes) where $Answer is the "
               "answer to the problem.\n\n")
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
THINK_SUFFIX = ("\n\nFirst think through the problem step by step inside <think> and </think>. "
                'Then, after </think>, give the final answer on its own line after "Answer:".')


def check_template(template: str, tokenizer: Any | None = None) -> None:
  """ValueError for an unknown template, or for "chat" without a tokenizer."""
  if template not in TEMPLATES:
    raise ValueError(f"unknown prompt template {template!r}; allowed: {', '.join(TEMPLATES)}")
  if template == "chat" and tokenizer is None:
    raise ValueError("prompt template 'chat' needs a tokenizer (its chat template)")


def messages(record: Mapping[str, Any]) -> list[dict[str, str]]:
  """The chat turns of a record: one user turn holding its prompt."""
  return [{"role": "user", "content": record["prompt"]}]


def render(record: Mapping[str, Any], template: str, tokenizer: Any | None = None) -> str:
  """The prompt text of `record` under `template` ("chat" needs `tokenizer`)."""
  check_template(template, tokenizer)
  prompt = record["prompt"]
  if template == "plain":
    return prompt
  if template == "dapo":
    return DAPO_PREFIX + prompt + DAPO_SUFFIX
  if template == "think":
    return prompt + THINK_SUFFIX
  return tokenizer.apply_chat_template(messages(record), tokenize=False)


def encode(record: Mapping[str, Any], template: str, tokenizer: Any) -> list[int]:
  """Token ids of `record`'s prompt under `template`."""
  check_template(template, tokenizer)
  if template == "chat":
    return list(tokenizer.apply_chat_template(messages(record)))
  return tokenizer.encode(render(record, template), add_bos=True)


def prompt_of(entry: dict) -> str:
  """The question of a data entry: its "prompt" (records, puzzles) or "question" (eval sets)."""
  return entry["prompt"] if "prompt" in entry else entry["question"]
