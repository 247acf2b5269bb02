"""Tests for models/tokenizer.py: byte round-trips, HF checkpoints against `tokenizers` and
`transformers`, chat templates, and bucketed padding.

The HF checkpoints are built here: a small byte-level BPE trained with `tokenizers` on a few
sentences, with a Qwen-style chat template (ChatML, default system turn, tools, thinking switch)
or a Llama-style one (bos in the template, template in chat_template.jinja).
"""

import json

import jinja2
import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from models.tokenizer import (ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer,
                              pad_batch)

QWEN_STYLE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- '\\n\\n# Tools\\n\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0]['role'] != 'system' %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unsupported role: ' + message['role']) }}
    {%- endif %}
    {%- if not (tools and loop.first and message['role'] == 'system') %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

LLAMA_STYLE_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

TEXTS = [
    "",
    "hello world",
    "the quick brown fox jumps over the lazy dog",
    "  leading spaces,\ttabs\n\nand newlines ",
    "naïve café – 日本語 🎉👩‍👩‍👧",
    "<|im_start|>user\nhi<|im_end|>",
    "<think>step one</think> the answer is 42",
]

MESSAGES = [
    {"role": "system", "content": "Reason step by step."},
    {"role": "user", "content": "What is 6 × 7?"},
    {"role": "assistant", "content": "<think>6 × 7 = 42</think>42"},
    {"role": "user", "content": "And 6 × 8?"},
]

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "a < b & c > d", "parameters": {"type": "object"}}}]


def _train_tiny_bpe() -> tokenizers.Tokenizer:
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tokenizer.train_from_iterator(TEXTS + [m["content"] for m in MESSAGES] * 5, trainer)
  # As in Qwen3: reasoning markers are single added tokens, but not special ones.
  tokenizer.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                        for t in ("<think>", "</think>")])
  return tokenizer


@pytest.fixture(scope="module")
def bpe_tokenizer():
  return _train_tiny_bpe()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, bpe_tokenizer):
  path = tmp_path_factory.mktemp("qwen_style")
  bpe_tokenizer.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
      "chat_template": QWEN_STYLE_TEMPLATE}))
  (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
  return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, bpe_tokenizer):
  path = tmp_path_factory.mktemp("llama_style")
  bpe_tokenizer.save(str(path / "tokenizer.json"))
  endoftext = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
  (path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": endoftext, "eos_token": endoftext,
      "chat_template": "stale template that chat_template.jinja overrides"}))
  (path / "chat_template.jinja").write_text(LLAMA_STYLE_TEMPLATE)
  return path


# ----------------------------------------------------------------------------- Byte tokenizer

@pytest.mark.parametrize("text", TEXTS + ["\x00\x7f\x80 control bytes", "a" * 1000])
def test_byte_round_trip(text):
  """decode(encode(s)) == s for any UTF-8 string, one id per byte when there are no markers."""
  tok = ByteTokenizer()
  ids = tok.encode(text)
  assert tok.decode(ids, skip_special=False) == text
  assert all(0 <= i < tok.vocab_size for i in ids)
  if not any(token in text for token in ByteTokenizer.SPECIAL_TOKENS):
    assert tok.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))


def test_byte_special_tokens_are_single_ids():
  """Every special string encodes to one id and decodes back; skip_special drops only control."""
  tok = ByteTokenizer()
  for token_id, token in enumerate(ByteTokenizer.SPECIAL_TOKENS):
    assert tok.encode(token) == [token_id]
    assert tok.token_to_id(token) == token_id
    assert tok.decode([token_id], skip_special=False) == token
  ids = tok.encode("<bos><think>a</think>b<|im_end|><eos><pad>")
  assert tok.decode(ids) == "<think>a</think>b"
  assert tok.encode("x", add_bos=True) == [tok.bos_id, tok.token_to_id("x")]


def test_byte_properties():
  """Ids are distinct, the vocabulary tiles by 8, and turns stop at eos or <|im_end|>."""
  tok = ByteTokenizer()
  assert isinstance(tok, Tokenizer)
  assert tok.vocab_size == 264 and tok.vocab_size % 8 == 0
  assert tok.pad_id == 0 and len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
  assert tok.stop_ids == (tok.eos_id, tok.token_to_id("<|im_end|>"))
  assert tok.batch_encode(["ab", ""]) == [tok.encode("ab"), []]


def test_byte_decode_is_total():
  """Ids an untrained policy may sample (the spare id, broken UTF-8) decode without raising."""
  tok = ByteTokenizer()
  spare_id = tok.vocab_size - 1
  assert tok.decode([tok.token_to_id("a"), spare_id, tok.token_to_id("b")]) == "ab"
  broken = [0xF0 + tok.BYTE_OFFSET, tok.token_to_id("a")]
  assert tok.decode(np.array(broken)) == "\ufffda"


def test_byte_chat_template():
  """The built-in template is ChatML with an optional assistant prompt, tokenized via encode."""
  tok = ByteTokenizer()
  messages = [{"role": "user", "content": "hi"}]
  text = tok.apply_chat_template(messages, tokenize=False)
  assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
  no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
  assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"
  assert tok.apply_chat_template(messages) == tok.encode(text)
  with pytest.raises(ValueError, match="role"):
    tok.apply_chat_template([{"content": "no role"}])


def test_byte_and_hf_render_the_same_chatml(qwen_dir):
  """With a system turn, the byte template and a Qwen-style HF template give the same prompt."""
  byte_text = ByteTokenizer().apply_chat_template(MESSAGES, tokenize=False)
  hf_text = HFTokenizer(qwen_dir).apply_chat_template(MESSAGES, tokenize=False)
  assert byte_text == hf_text


# ----------------------------------------------------------------------------- HF tokenizer

def test_hf_encode_matches_tokenizers(qwen_dir, bpe_tokenizer):
  """encode/batch_encode equal the `tokenizers` library's ids; decode inverts them."""
  tok = HFTokenizer(qwen_dir)
  expected = [bpe_tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS]
  assert [tok.encode(t) for t in TEXTS] == expected
  assert tok.batch_encode(TEXTS) == expected
  for text, ids in zip(TEXTS, expected):
    assert tok.decode(ids, skip_special=False) == text
  assert tok.encode("<|im_end|>") == [2]
  assert tok.decode(tok.encode("<|im_start|>a<think>b</think><|im_end|>")) == "a<think>b</think>"


def test_hf_special_tokens_qwen_style(qwen_dir, bpe_tokenizer):
  """Qwen style: no bos, eos and pad from the config, stops from generation_config, no dups."""
  tok = HFTokenizer(qwen_dir)
  assert isinstance(tok, Tokenizer)
  assert tok.bos_id is None and tok.encode("hi", add_bos=True) == tok.encode("hi")
  assert tok.eos_id == 2 and tok.pad_id == 0
  assert tok.stop_ids == (2, 0)
  assert tok.vocab_size == bpe_tokenizer.get_vocab_size(with_added_tokens=True)
  assert tok.token_to_id("<think>") == bpe_tokenizer.token_to_id("<think>")


def test_hf_special_tokens_llama_style(llama_dir):
  """AddedToken dicts resolve, bos is prepended on request, pad falls back to eos, and
  <|im_end|> still stops generation when eos is <|endoftext|>."""
  tok = HFTokenizer(llama_dir)
  assert tok.bos_id == tok.eos_id == tok.pad_id == 0
  assert tok.encode("hi", add_bos=True) == [0, *tok.encode("hi")]
  assert tok.batch_encode(["hi"], add_bos=True) == [[0, *tok.encode("hi")]]
  assert tok.stop_ids == (0, 2)


def test_hf_chat_template_qwen_style(qwen_dir):
  """The template sees messages, add_generation_prompt, kwargs, tojson, and raise_exception."""
  tok = HFTokenizer(qwen_dir)
  user_only = [{"role": "user", "content": "hi"}]
  text = tok.apply_chat_template(user_only, tokenize=False, enable_thinking=False)
  assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                  "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert tok.apply_chat_template(user_only, enable_thinking=False) == tok.encode(text)
  with_tools = tok.apply_chat_template(user_only, tokenize=False, tools=TOOLS)
  assert '"description": "a < b & c > d"' in with_tools
  with pytest.raises(jinja2.exceptions.TemplateError, match="Unsupported role: tool"):
    tok.apply_chat_template([{"role": "tool", "content": "4"}])


def test_hf_chat_template_from_jinja_file(llama_dir):
  """chat_template.jinja wins over the config's template, and bos_token/eos_token are set."""
  tok = HFTokenizer(llama_dir)
  text = tok.apply_chat_template([{"role": "user", "content": " hi "}], tokenize=False)
  assert text == "<|endoftext|><|im_start|>user\nhi<|endoftext|><|im_start|>assistant\n"
  assert tok.apply_chat_template([{"role": "user", "content": " hi "}])[0] == tok.bos_id


@pytest.mark.parametrize("style", ["qwen", "llama"])
def test_hf_matches_transformers(style, qwen_dir, llama_dir, monkeypatch):
  """transformers.AutoTokenizer gives the same ids, decodes, and chat-template strings."""
  transformers = pytest.importorskip("transformers", reason="transformers is a test-only extra")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  path = qwen_dir if style == "qwen" else llama_dir
  ours = HFTokenizer(path)
  theirs = transformers.AutoTokenizer.from_pretrained(str(path))
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
  assert (ours.eos_id, ours.bos_id) == (theirs.eos_token_id, theirs.bos_token_id)
  # transformers leaves pad unset when the config has none; ours falls back to eos.
  assert ours.pad_id == (theirs.eos_token_id if theirs.pad_token_id is None
                         else theirs.pad_token_id)
  cases = [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
           dict(add_generation_prompt=True, enable_thinking=False)]
  if style == "qwen":
    cases.append(dict(add_generation_prompt=True, tools=TOOLS))
  for kwargs in cases:
    for messages in (MESSAGES, MESSAGES[1:]):
      text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
      assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
      assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(
          messages, tokenize=True, return_dict=False, **kwargs)


def test_hf_missing_files_name_the_path(tmp_path, bpe_tokenizer):
  """A directory without tokenizer.json, or without a template, fails with its path named."""
  with pytest.raises(FileNotFoundError, match=str(tmp_path / "tokenizer.json")):
    HFTokenizer(tmp_path)
  bpe_tokenizer.save(str(tmp_path / "tokenizer.json"))
  with pytest.raises(ValueError, match=f"{tmp_path}: no eos_token"):
    HFTokenizer(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  tok = HFTokenizer(tmp_path)
  with pytest.raises(ValueError, match=f"{tmp_path}: no chat template"):
    tok.apply_chat_template(MESSAGES)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|missing|>"}))
  with pytest.raises(ValueError, match="'<|missing|>' is not in tokenizer.json"):
    HFTokenizer(tmp_path)


def test_load_tokenizer_dispatch(qwen_dir, tmp_path):
  """The spec "byte" gives ByteTokenizer, a directory HFTokenizer, anything else an error."""
  assert isinstance(load_tokenizer("byte"), ByteTokenizer)
  assert isinstance(load_tokenizer(qwen_dir), HFTokenizer)
  assert isinstance(load_tokenizer(str(qwen_dir)), HFTokenizer)
  missing = tmp_path / "nope"
  with pytest.raises(FileNotFoundError, match="nope"):
    load_tokenizer(missing)


# ----------------------------------------------------------------------------- Padding

def test_pad_batch_right_and_left():
  """Right padding keeps tokens at the start, left at the end; lengths count real tokens."""
  sequences = [[5, 6, 7], [8], []]
  ids, lengths = pad_batch(sequences, pad_id=0)
  assert ids.dtype == np.int32 and lengths.dtype == np.int32
  np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(lengths, [3, 1, 0])
  ids, lengths = pad_batch(sequences, pad_id=9, side="left")
  np.testing.assert_array_equal(ids, [[5, 6, 7], [9, 9, 8], [9, 9, 9]])
  np.testing.assert_array_equal(lengths, [3, 1, 0])


def test_pad_batch_buckets():
  """L is `length` or the longest, rounded up to `multiple_of`; overflow raises."""
  assert pad_batch([[1] * 5, [2]], multiple_of=4, pad_id=0)[0].shape == (2, 8)
  assert pad_batch([[1] * 8], multiple_of=4, pad_id=0)[0].shape == (1, 8)
  assert pad_batch([[]], multiple_of=4, pad_id=0)[0].shape == (1, 4)
  assert pad_batch([[1, 2]], length=6, pad_id=0)[0].shape == (1, 6)
  assert pad_batch([[1, 2]], length=6, multiple_of=4, pad_id=0)[0].shape == (1, 8)
  assert pad_batch([], length=4, pad_id=0)[0].shape == (0, 4)
  with pytest.raises(ValueError, match="3 tokens does not fit in length 2"):
    pad_batch([[1, 2, 3]], length=2, pad_id=0)
  with pytest.raises(ValueError, match="side"):
    pad_batch([[1]], pad_id=0, side="middle")
