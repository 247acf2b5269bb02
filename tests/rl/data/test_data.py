"""Prompt sources, templates and the grain loader (rl/data/sources.py, rl/data/templates.py)."""

import importlib.util
import json
import logging

import pytest

from models.tokenizer import ByteTokenizer
from rl.data import sources, templates


def write_jsonl(path, rows):
  """Rows are dicts (written as JSON), or str / bytes lines written as they are."""
  lines = [row if isinstance(row, bytes) else
           (row if isinstance(row, str) else json.dumps(row)).encode() for row in rows]
  path.write_bytes(b"".join(line + b"\n" for line in lines))
  return path


def make_records(count):
  return [sources.normalize_record({"prompt": f"p{i}", "answer": str(i)}, default_source="t")
          for i in range(count)]


def prompts_of(batches):
  return [[record["prompt"] for record in batch] for batch in batches]


# ----------------------------------------------------------------------------- Loading

def test_jsonl_fields_defaults_and_extra_fields(tmp_path):
  """Canonical fields get their defaults, blank lines are ignored, extra fields are kept."""
  path = write_jsonl(tmp_path / "gsm8k.jsonl", [
      {"prompt": "1+1?", "answer": "2", "numbers": [1, 1]},
      "   ",
      {"prompt": "Write f.", "domain": "code", "tests": ["assert f() == 1"], "difficulty": 3,
       "data_source": "mbpp"},
  ])
  records, stats = sources.load_records(path)
  assert records == [
      {"prompt": "1+1?", "answer": "2", "numbers": [1, 1], "data_source": "gsm8k",
       "domain": "math"},
      {"prompt": "Write f.", "domain": "code", "tests": ["assert f() == 1"], "difficulty": 3,
       "data_source": "mbpp"},
  ]
  assert (stats.loaded, stats.skipped) == (2, 0)


def test_parquet_rows_numbers_and_nulls(tmp_path):
  """Parquet rows load like jsonl rows: numeric answers become strings, null fields are absent."""
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  path = tmp_path / "aime.parquet"
  pq.write_table(pa.table({"problem": ["Find x.", "Find y."], "answer": [42, None],
                           "difficulty": [None, 2.5]}), path)
  records, stats = sources.load_records(str(path))
  assert records == [
      {"problem": "Find x.", "prompt": "Find x.", "answer": "42", "data_source": "aime",
       "domain": "math"},
      {"problem": "Find y.", "prompt": "Find y.", "difficulty": 2.5, "data_source": "aime",
       "domain": "math"},
  ]
  assert stats.loaded_by_file == {str(path): 2}


def test_parquet_bad_row_names_row_number(tmp_path):
  """A bad parquet row is reported by its 1-based row number."""
  pa = pytest.importorskip("pyarrow")
  pq = pytest.importorskip("pyarrow.parquet")
  path = tmp_path / "bad.parquet"
  pq.write_table(pa.table({"prompt": ["ok", None, "ok"]}), path)
  with pytest.raises(ValueError, match=r"bad\.parquet row 2: no prompt"):
    sources.load_records(path)


@pytest.mark.parametrize("row, prompt, answer", [
    ({"question": "Q", "solution": "S"}, "Q", "S"),
    ({"problem": "P", "final_answer": "F"}, "P", "F"),
    ({"prompt": "main", "question": "alias", "answer": "A", "solution": "S"}, "main", "A"),
    ({"question": None, "problem": "P", "answer": None, "final_answer": 7}, "P", "7"),
])
def test_aliases(tmp_path, row, prompt, answer):
  """question/problem stand in for prompt, solution/final_answer for answer, canonical first."""
  records, _ = sources.load_records(write_jsonl(tmp_path / "a.jsonl", [row]))
  assert (records[0]["prompt"], records[0]["answer"]) == (prompt, answer)


@pytest.mark.parametrize("bad_line, reason", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"answer": "2"}', "no prompt"),
    ('{"prompt": 5}', "'prompt' must be a non-empty string"),
    ('{"prompt": "  "}', "'prompt' must be a non-empty string"),
    ('{"prompt": "q", "domain": "poetry"}', "'domain' must be one of"),
    ('{"prompt": "q", "tests": "assert True"}', "'tests' must be a list"),
    ('{"prompt": "q", "difficulty": "hard"}', "'difficulty' must be a number"),
    ('{"prompt": "q", "answer": true}', "'answer' must be a string or a number"),
    ('{"prompt": "q", "data_source": 3}', "'data_source' must be a string"),
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8"),
])
def test_malformed_record_names_file_and_line(tmp_path, bad_line, reason):
  """A malformed row raises ValueError naming the file and its 1-based line."""
  path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a"}, "", bad_line, {"prompt": "b"}])
  with pytest.raises(ValueError) as error:
    sources.load_records(path)
  assert str(error.value).startswith(f"{path}:3: ")
  assert reason in str(error.value)


def test_skip_bad_counts_and_logs(tmp_path, caplog):
  """With skip_bad, bad rows are skipped, counted per file and logged with their location."""
  first = write_jsonl(tmp_path / "first.jsonl", [{"prompt": "a"}, "oops", {"answer": "1"}])
  second = write_jsonl(tmp_path / "second.jsonl", [{"question": "b"}])
  with caplog.at_level(logging.WARNING):
    records, stats = sources.load_records([first, second], skip_bad=True)
  assert [r["prompt"] for r in records] == ["a", "b"]
  assert (stats.loaded, stats.skipped) == (2, 2)
  assert stats.skipped_by_file == {str(first): 2, str(second): 0}
  assert f"{first}:2" in caplog.text and f"{first}:3" in caplog.text


def test_missing_file_glob_and_unknown_type(tmp_path):
  """Missing paths and unsupported types fail with the path; a glob reads its matches sorted."""
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    sources.load_records(tmp_path / "nope.jsonl")
  with pytest.raises(FileNotFoundError, match=r"\*\.jsonl"):
    sources.load_records(str(tmp_path / "*.jsonl"))
  (tmp_path / "x.csv").write_text("prompt\nq\n")
  with pytest.raises(ValueError, match="unsupported prompt file type '.csv'"):
    sources.load_records(tmp_path / "x.csv")
  write_jsonl(tmp_path / "b.jsonl", [{"prompt": "from b"}])
  write_jsonl(tmp_path / "a.jsonl", [{"prompt": "from a"}])
  records, _ = sources.load_records(str(tmp_path / "*.jsonl"))
  assert [(r["prompt"], r["data_source"]) for r in records] == [("from a", "a"), ("from b", "b")]


def test_tfds_without_the_package_says_how_to_install():
  """A tfds: input without tensorflow-datasets fails with an install hint."""
  if importlib.util.find_spec("tensorflow_datasets") is not None:
    pytest.skip("tensorflow-datasets is installed")
  with pytest.raises(ImportError, match=r"tfds:gsm8k/train: .*tensorflow-datasets"):
    sources.load_records("tfds:gsm8k/train")


# ----------------------------------------------------------------------------- Templates

def test_templates_render():
  """Each template wraps the prompt as documented; DAPO's wording is exact."""
  record = {"prompt": "What is 2+3?"}
  assert templates.render(record, "plain") == "What is 2+3?"
  assert templates.render(record, "dapo") == (
      "Solve the following math problem step by step. The last line of your response should be "
      "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
      "\n\nWhat is 2+3?\n\nRemember to put your answer on its own line after \"Answer:\".")
  think = templates.render(record, "think")
  assert think.startswith("What is 2+3?") and "<think>" in think and "Answer:" in think
  chat = templates.render(record, "chat", ByteTokenizer())
  assert chat == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


def test_templates_encode_and_errors():
  """encode adds bos to text templates and uses the chat template for "chat"; bad names fail."""
  tokenizer = ByteTokenizer()
  record = {"prompt": "hi"}
  assert templates.encode(record, "plain", tokenizer) == tokenizer.encode("hi", add_bos=True)
  assert templates.encode(record, "chat", tokenizer) == tokenizer.apply_chat_template(
      [{"role": "user", "content": "hi"}])
  with pytest.raises(ValueError, match="allowed: plain, dapo, think, chat"):
    templates.render(record, "fancy")
  with pytest.raises(ValueError, match="needs a tokenizer"):
    templates.render(record, "chat")


# ----------------------------------------------------------------------------- Bad input

def test_non_parquet_file_named_as_parquet_names_the_file(tmp_path):
  """A .parquet file that is not parquet (here JSON lines) fails naming the file."""
  path = write_jsonl(tmp_path / "prompts.parquet", [{"prompt": "a"}])
  with pytest.raises(ValueError, match=rf"{path}: not a readable parquet file"):
    sources.load_records(path)


def files_config(tmp_path, rows, **data):
  """A config reading `rows` (dicts) from train.jsonl, with one ordinary held-out prompt."""
  from rl.config.defaults import base_config
  c = base_config(preset="tiny_dense", algorithm="grpo")
  c.data.update(source="files", train_files=str(write_jsonl(tmp_path / "train.jsonl", rows)),
                heldout_files=str(write_jsonl(tmp_path / "heldout.jsonl",
                                              [{"prompt": "1+1?", "answer": "2"}])), **data)
  return c


def test_prompts_longer_than_the_context_fail_naming_file_and_line(tmp_path):
  """A prompt that leaves the response no room in the model's context (max_seq_len 256 - 16
  new tokens) is an error naming its file and line; a 10 MB one fails the same way at once
  (no attempt to allocate for it); one that fits exactly is kept."""
  from rl.data import entries
  tokenizer = ByteTokenizer()
  c = files_config(tmp_path, [{"prompt": "x" * 239, "answer": "1"},  # + 1 template token
                              {"prompt": "y" * 240, "answer": "1"}])
  with pytest.raises(ValueError, match=rf"{tmp_path}/train.jsonl:2: prompt of 241 tokens, more "
                                       r"than the 240 the model's context leaves"):
    entries.load_entries(c, tokenizer)
  c = files_config(tmp_path, [{"prompt": "ok", "answer": "1"},
                              {"prompt": "z" * 10_000_000, "answer": "1"}])
  with pytest.raises(ValueError, match=r"train.jsonl:2: prompt of 10000001 tokens"):
    entries.load_entries(c, tokenizer)


def test_prompts_longer_than_the_context_are_skipped_and_counted(tmp_path, caplog):
  """With config.data.skip_bad_records the long prompts are dropped, counted and logged with
  their location; the others are kept in order."""
  from rl.data import entries
  rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b" * 300, "answer": "1"},
          {"prompt": "c", "answer": "1"}, {"prompt": "d" * 500, "answer": "1"}]
  c = files_config(tmp_path, rows, skip_bad_records=True)
  with caplog.at_level(logging.WARNING):
    train, heldout = entries.load_entries(c, ByteTokenizer())
  assert [e["prompt"] for e in train] == ["a", "c"] and len(heldout) == 1
  assert "train.jsonl:2" in caplog.text and "train.jsonl:4" in caplog.text
  assert "skipped 2 of 4 prompts longer than the context" in caplog.text
