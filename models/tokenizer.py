"""Tokenizers behind one interface: a built-in byte tokenizer and a local HF checkpoint.

`load_tokenizer("byte")` gives `ByteTokenizer`, which needs no files and serves the demo and the
tests; `load_tokenizer("/path/to/checkpoint")` gives `HFTokenizer`, which reads the checkpoint's
`tokenizer.json` with the `tokenizers` library and renders its chat template with a sandboxed
Jinja environment set up the way `transformers` sets it up, so prompts and ids match what the
model was trained on without importing `transformers`.

Both follow HF conventions where they meet: special-token strings inside text encode to their
single ids; `decode(..., skip_special=True)` drops control tokens (pad, bos, eos, turn markers)
but keeps `<think>`/`</think>`, which are ordinary added tokens that reward parsers need to see;
ids the tokenizer does not know decode to nothing rather than raising, because an untrained
policy can sample them from a padded logit row.

`pad_batch` turns ragged id lists into the fixed, bucketed int32 shapes that jitted rollout and
update steps need.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np
import tokenizers

from models.padding import round_up

Message = Mapping[str, Any]


@runtime_checkable
class Tokenizer(Protocol):
  """What the rollout engine, the data pipeline and the rewards rely on."""

  @property
  def vocab_size(self) -> int:
    """Number of embedding rows the model needs: one past the largest id the tokenizer emits."""

  @property
  def pad_id(self) -> int: ...

  @property
  def bos_id(self) -> int | None:
    """None for tokenizers without a beginning-of-sequence token (e.g. Qwen)."""

  @property
  def eos_id(self) -> int: ...

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a sampled completion: eos and the end-of-turn markers."""

  def token_to_id(self, token: str) -> int | None: ...

  def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

  def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str: ...

  def batch_encode(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]: ...

  def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                          tokenize: bool = True, **template_kwargs: Any) -> list[int] | str: ...


# ----------------------------------------------------------------------------- Byte tokenizer

# ChatML turn markers, the same strings Qwen uses, so prompts read alike under both tokenizers.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_START = "<think>"
THINK_END = "</think>"


class ByteTokenizer:
  """UTF-8 bytes shifted past a handful of special tokens; exact round-trip for any string.

  Ids 0..6 are `<pad>`, `<bos>`, `<eos>`, `<|im_start|>`, `<|im_end|>`, `<think>`, `</think>`;
  byte b is id b + 7. That makes 263 ids; `vocab_size` is 264 so that embedding and logit
  tables tile by 8, and the spare id decodes to nothing.
  """

  SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", IM_START, IM_END, THINK_START, THINK_END)
  # Reasoning markers are content the reward parses, not control tokens, as in Qwen3.
  KEPT_ON_DECODE = (THINK_START, THINK_END)
  BYTE_OFFSET = len(SPECIAL_TOKENS)

  def __init__(self):
    self._special_to_id = {token: i for i, token in enumerate(self.SPECIAL_TOKENS)}
    self._skipped_ids = frozenset(
        i for i, token in enumerate(self.SPECIAL_TOKENS) if token not in self.KEPT_ON_DECODE)
    # Longest first so that no marker is split by a shorter one sharing its prefix.
    ordered = sorted(self.SPECIAL_TOKENS, key=len, reverse=True)
    self._special_pattern = re.compile("|".join(re.escape(token) for token in ordered))

  @property
  def vocab_size(self) -> int:
    return round_up(self.BYTE_OFFSET + 256, 8)

  @property
  def pad_id(self) -> int:
    return self._special_to_id["<pad>"]

  @property
  def bos_id(self) -> int:
    return self._special_to_id["<bos>"]

  @property
  def eos_id(self) -> int:
    return self._special_to_id["<eos>"]

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return (self.eos_id, self._special_to_id[IM_END])

  def token_to_id(self, token: str) -> int | None:
    if token in self._special_to_id:
      return self._special_to_id[token]
    encoded = token.encode("utf-8")
    return encoded[0] + self.BYTE_OFFSET if len(encoded) == 1 else None

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    ids = [self.bos_id] if add_bos else []
    position = 0
    for match in self._special_pattern.finditer(text):
      ids.extend(self._encode_bytes(text[position:match.start()]))
      ids.append(self._special_to_id[match.group()])
      position = match.end()
    ids.extend(self._encode_bytes(text[position:]))
    return ids

  def _encode_bytes(self, text: str) -> list[int]:
    return [byte + self.BYTE_OFFSET for byte in text.encode("utf-8")]

  def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
    pieces = []
    pending = bytearray()
    for token_id in (int(i) for i in ids):
      if self.BYTE_OFFSET <= token_id < self.BYTE_OFFSET + 256:
        pending.append(token_id - self.BYTE_OFFSET)
      elif 0 <= token_id < self.BYTE_OFFSET:
        if skip_special and token_id in self._skipped_ids:
          continue
        # Sampled bytes need not form valid UTF-8; replacement keeps decoding total.
        pieces.append(pending.decode("utf-8", errors="replace"))
        pending.clear()
        pieces.append(self.SPECIAL_TOKENS[token_id])
    pieces.append(pending.decode("utf-8", errors="replace"))
    return "".join(pieces)

  def batch_encode(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
    return [self.encode(text, add_bos=add_bos) for text in texts]

  def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                          tokenize: bool = True, **template_kwargs: Any) -> list[int] | str:
    """ChatML: `<|im_start|>{role}\\n{content}<|im_end|>\\n` per turn, no default system turn.

    The built-in template reads no options, so `template_kwargs` are accepted and ignored, as a
    Jinja chat template ignores variables it does not use.
    """
    del template_kwargs
    parts = []
    for message in messages:
      role, content = message.get("role"), message.get("content")
      if not isinstance(role, str) or not isinstance(content, str):
        raise ValueError(f"chat messages need string 'role' and 'content', got {message!r}")
      parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
      parts.append(f"{IM_START}assistant\n")
    text = "".join(parts)
    return self.encode(text) if tokenize else text


# ----------------------------------------------------------------------------- HF checkpoint

# End-of-turn markers that stop generation even when the checkpoint's eos is a different token:
# a Qwen base model's eos is <|endoftext|>, but under the chat template a turn ends at <|im_end|>.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class HFTokenizer:
  """A local HF checkpoint's tokenizer: `tokenizer.json` plus its config files.

  Reads `tokenizer.json` (required), `special_tokens_map.json` and `tokenizer_config.json`
  (special tokens; the latter wins), the chat template from `chat_template.jinja` or else
  `tokenizer_config.json`, and `generation_config.json`'s `eos_token_id` for extra stop ids.
  """

  def __init__(self, path: str | os.PathLike):
    self.path = pathlib.Path(path)
    tokenizer_file = self.path / "tokenizer.json"
    if not tokenizer_file.is_file():
      raise FileNotFoundError(
          f"{tokenizer_file} not found: HFTokenizer needs a fast-tokenizer tokenizer.json "
          "(checkpoints with only a sentencepiece/vocab file must be converted first)")
    self._tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    config = {**_read_json(self.path / "special_tokens_map.json"),
              **_read_json(self.path / "tokenizer_config.json")}
    generation_config = _read_json(self.path / "generation_config.json")

    # Token strings, for the chat template; only the ones that are set, because a template
    # printing `{{ bos_token }}` must render nothing, not "None", when there is none.
    tokens = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
    self._special_tokens = {name: token for name, token in tokens.items() if token is not None}

    generation_eos = generation_config.get("eos_token_id")
    generation_eos_ids = ([generation_eos] if isinstance(generation_eos, int)
                          else list(generation_eos or []))
    if "eos_token" in self._special_tokens:
      self._eos_id = self._required_id("eos_token")
    elif generation_eos_ids:
      self._eos_id = generation_eos_ids[0]
    else:
      raise ValueError(f"{self.path}: no eos_token in tokenizer_config.json or "
                       "special_tokens_map.json, and no eos_token_id in generation_config.json")
    self._bos_id = self._required_id("bos_token") if "bos_token" in self._special_tokens else None
    # Padding is masked out by the lengths, so any valid id serves when none is configured.
    self._pad_id = (self._required_id("pad_token") if "pad_token" in self._special_tokens
                    else self._eos_id)

    added = self._tokenizer.get_added_tokens_decoder()
    end_of_turn_ids = [i for i, token in sorted(added.items())
                       if token.special and token.content in END_OF_TURN_TOKENS]
    self._stop_ids = tuple(dict.fromkeys([self._eos_id, *generation_eos_ids, *end_of_turn_ids]))
    self._vocab_size = max(self._tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    template_source = self._read_chat_template(config)
    self._chat_template = (_compile_chat_template(template_source, self.path)
                           if template_source is not None else None)

  def _required_id(self, name: str) -> int:
    token = self._special_tokens[name]
    token_id = self._tokenizer.token_to_id(token)
    if token_id is None:
      raise ValueError(f"{self.path}: {name} {token!r} is not in tokenizer.json's vocabulary")
    return token_id

  def _read_chat_template(self, config: Mapping[str, Any]) -> str | None:
    # Recent transformers saves the template as its own file and drops it from the config.
    jinja_file = self.path / "chat_template.jinja"
    if jinja_file.is_file():
      return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
      # Older multi-template format: [{"name": ..., "template": ...}]; "default" is the chat one.
      named = {entry["name"]: entry["template"] for entry in template}
      if "default" not in named:
        raise ValueError(f"{self.path}: chat templates {sorted(named)} have no 'default' entry")
      return named["default"]
    return template

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def bos_id(self) -> int | None:
    return self._bos_id

  @property
  def eos_id(self) -> int:
    return self._eos_id

  @property
  def stop_ids(self) -> tuple[int, ...]:
    return self._stop_ids

  def token_to_id(self, token: str) -> int | None:
    return self._tokenizer.token_to_id(token)

  def encode(self, text: str, add_bos: bool = False) -> list[int]:
    # The post-processor (e.g. Llama's automatic bos) stays off: bos is explicit here, and chat
    # templates write it into the text themselves.
    ids = self._tokenizer.encode(text, add_special_tokens=False).ids
    return [self._bos_id, *ids] if add_bos and self._bos_id is not None else ids

  def decode(self, ids: Sequence[int] | np.ndarray, skip_special: bool = True) -> str:
    return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def batch_encode(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
    encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
    prefix = [self._bos_id] if add_bos and self._bos_id is not None else []
    return [prefix + encoding.ids for encoding in encodings]

  def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                          tokenize: bool = True, **template_kwargs: Any) -> list[int] | str:
    """Renders the checkpoint's template; `template_kwargs` (e.g. `enable_thinking`, `tools`)
    become template variables, as in `transformers`."""
    if self._chat_template is None:
      raise ValueError(f"{self.path}: no chat template in chat_template.jinja or "
                       "tokenizer_config.json")
    variables = {"tools": None, "documents": None, **self._special_tokens, **template_kwargs}
    text = self._chat_template.render(messages=[dict(m) for m in messages],
                                      add_generation_prompt=add_generation_prompt, **variables)
    return self.encode(text) if tokenize else text


def _compile_chat_template(source: str, path: pathlib.Path) -> jinja2.Template:
  """Compiles with the environment `transformers` uses, so templates render identically.

  Chat templates come from checkpoints, i.e. untrusted code, hence the immutable sandbox.
  """

  def raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes '<', '>' and '&', which would change tool schemas.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(format_string: str) -> str:
    return datetime.datetime.now().strftime(format_string)

  environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  environment.filters["tojson"] = tojson
  environment.globals["raise_exception"] = raise_exception
  environment.globals["strftime_now"] = strftime_now
  try:
    return environment.from_string(source)
  except jinja2.exceptions.TemplateSyntaxError as error:
    raise ValueError(f"{path}: chat template does not parse: {error}") from error


def _read_json(path: pathlib.Path) -> dict[str, Any]:
  """The file's JSON object, or {} when the (optional) file is absent."""
  if not path.is_file():
    return {}
  with path.open(encoding="utf-8") as f:
    return json.load(f)


def _token_content(token: Any) -> str | None:
  # Configs store a special token either as its string or as a serialised AddedToken dict.
  if isinstance(token, Mapping):
    return token.get("content")
  return token


# ----------------------------------------------------------------------------- Loading

def load_tokenizer(spec: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
  """`"byte"` for the built-in tokenizer, otherwise a local checkpoint directory."""
  if isinstance(spec, str) and spec == "byte":
    return ByteTokenizer()
  path = pathlib.Path(spec)
  if not path.is_dir():
    raise FileNotFoundError(
        f"tokenizer spec {str(spec)!r} is neither 'byte' nor an existing directory")
  return HFTokenizer(path)


# ----------------------------------------------------------------------------- Padding

def pad_batch(sequences: Sequence[Sequence[int]], *, length: int | None = None,
              multiple_of: int | None = None, pad_id: int,
              side: str = "right") -> tuple[np.ndarray, np.ndarray]:
  """Pads ragged id lists into `(ids_BL int32, lengths_B int32)`.

  L is `length` if given, else the longest sequence; `multiple_of` then rounds L up (to at
  least one bucket), so a few bucket sizes cover every batch and jitted steps compile once per
  bucket. Sequences longer than L raise rather than being cut, because which end to cut (prompt
  head or completion tail) is the caller's decision. `side="left"` right-aligns the tokens, as
  batched prefill with a shared final position wants.
  """
  if side not in ("right", "left"):
    raise ValueError(f"side must be 'right' or 'left', got {side!r}")
  lengths_B = np.array([len(s) for s in sequences], dtype=np.int32).reshape(-1)
  longest = int(lengths_B.max(initial=0))
  target = longest if length is None else length
  if multiple_of is not None:
    if multiple_of <= 0:
      raise ValueError(f"multiple_of must be positive, got {multiple_of}")
    target = round_up(max(target, 1), multiple_of)
  if longest > target:
    raise ValueError(f"a sequence of {longest} tokens does not fit in length {target}")
  ids_BL = np.full((len(sequences), target), pad_id, dtype=np.int32)
  for row, sequence in enumerate(sequences):
    if len(sequence):
      start = 0 if side == "right" else target - len(sequence)
      ids_BL[row, start:start + len(sequence)] = sequence
  return ids_BL, lengths_B
