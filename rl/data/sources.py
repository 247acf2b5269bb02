"""Prompt records from jsonl / parquet files (and TFDS when installed). The RL trainer draws
them in grain's epoch order (rl/data/curriculum.py `PromptCurriculum`).

A record is a plain dict. Canonical fields, filled in by `normalize_record`:

* `prompt` (str, required, non-empty). When absent, `question` then `problem` is used.
* `answer` (str, optional). When absent, `solution` then `final_answer` is used; a `solution`
  is taken verbatim (MATH's worked solutions end in a `\\boxed{}` that the math reward extracts).
  Integer and float answers (common in parquet columns) become strings; bools are rejected.
* `data_source` (str): default the file's stem (`gsm8k` for `data/gsm8k.jsonl`).
* `domain` (str, one of `DOMAINS`): default "math".
* `tests` (list, optional): test cases of a code prompt.
* `difficulty` (int or float, optional).

A field that holds None counts as absent. Every other field of the row is kept unchanged (the
alias fields too), because verifiers read dataset-specific fields (a puzzle's `numbers`, ...).

A path may be remote (`gs://bucket/prompts/*.jsonl`): it is read through etils.epath, as
checkpoints are, after a start-up check that the storage answers (rl/core/storage.py); a remote
glob may use `*` and `?` but not `**`.

Bad rows fail early: a line that is not JSON, a row that is not an object, a missing prompt or a
field of the wrong type raises InputError (a ValueError) naming the file and the 1-based line
(row, for parquet), unless `skip_bad=True`, which skips the row, counts it in `LoadStats` and
logs it. A file that is not what its suffix says (e.g. a .parquet that is not parquet) fails
naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from absl import logging
from etils import epath

from rl.core import storage
from rl.core.checks import InputError

# "planted": general prompts graded by the planted-preference rule (rl/rewards/planted.py).
DOMAINS = ("math", "code", "logic", "general", "planted")
PROMPT_ALIASES = ("prompt", "question", "problem")
ANSWER_ALIASES = ("answer", "solution", "final_answer")
TFDS_PREFIX = "tfds:"
# Skipped rows logged one by one per file; the rest only appear in the counts.
MAX_LOGGED_BAD_ROWS = 10


@dataclasses.dataclass
class LoadStats:
  """What `load_records` read: rows kept and skipped, in total and per file, and where each
kept record came from ("PATH:LINE" or "PATH row N", in the records' order)."""
  loaded: int = 0
  skipped: int = 0
  loaded_by_file: dict[str, int] = dataclasses.field(default_factory=dict)
  skipped_by_file: dict[str, int] = dataclasses.field(default_factory=dict)
  locations: list[str] = dataclasses.field(default_factory=list)


def _is_absent(row: Mapping[str, Any], key: str) -> bool:
  return row.get(key) is None


def _first_present(row: Mapping[str, Any], keys: Sequence[str]) -> tuple[str, Any] | None:
  for key in keys:
    if not _is_absent(row, key):
      return key, row[key]
  return None


def normalize_record(row: Any, *, default_source: str) -> dict[str, Any]:
  """The canonical record for one raw row (see the module docstring); ValueError if malformed."""
  if not isinstance(row, Mapping):
    raise ValueError(f"a record must be a JSON object, got {type(row).__name__}")
  record = dict(row)
  prompt = _first_present(row, PROMPT_ALIASES)
  if prompt is None:
    raise ValueError(f"no prompt: none of the fields {', '.join(PROMPT_ALIASES)} is set")
  key, value = prompt
  if not isinstance(value, str) or not value.strip():
    raise ValueError(f"field {key!r} must be a non-empty string, got {value!r:.80}")
  record["prompt"] = value

  answer = _first_present(row, ANSWER_ALIASES)
  if answer is None:
    record.pop("answer", None)
  else:
    key, value = answer
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
      raise ValueError(f"field {key!r} must be a string or a number, got {type(value).__name__}")
    record["answer"] = value if isinstance(value, str) else str(value)

  source = row.get("data_source")
  if source is None:
    source = default_source
  if not isinstance(source, str):
    raise ValueError(f"field 'data_source' must be a string, got {type(source).__name__}")
  record["data_source"] = source

  domain = row.get("domain")
  if domain is None:
    domain = "math"
  if domain not in DOMAINS:
    raise ValueError(f"field 'domain' must be one of {', '.join(DOMAINS)}, got {domain!r:.80}")
  record["domain"] = domain

  for key, types, expected in (("tests", (list,), "a list"),
                               ("difficulty", (int, float), "a number")):
    value = row.get(key)
    if value is None:
      record.pop(key, None)
    elif isinstance(value, bool) or not isinstance(value, types):
      raise ValueError(f"field {key!r} must be {expected}, got {type(value).__name__}")
  return record


# ----------------------------------------------------------------------------- Readers

def _read_jsonl(path: str) -> Iterator[tuple[int, Any]]:
  """(1-based line number, parsed row) for every non-blank line; a bad line yields its error."""
  with epath.Path(path).open("rb") as f:
    for line_number, raw_line in enumerate(f, start=1):
      try:
        line = raw_line.decode("utf-8")
      except UnicodeDecodeError as e:
        yield line_number, ValueError(f"not valid UTF-8 ({e.reason} at byte {e.start})")
        continue
      if not line.strip():
        continue
      try:
        yield line_number, json.loads(line)
      except json.JSONDecodeError as e:
        yield line_number, ValueError(f"not valid JSON ({e.msg} at column {e.colno})")


def _read_parquet(path: str) -> Iterator[tuple[int, Any]]:
  """(1-based row number, row dict), read one row group at a time to bound memory."""
  import pyarrow as pa  # Imported here: only parquet inputs need pyarrow.
  import pyarrow.parquet as pq
  row_number = 0
  with contextlib.ExitStack() as stack:
    # A local file is memory-mapped by pyarrow; a remote one is read through its file object.
    source = stack.enter_context(epath.Path(path).open("rb")) if storage.is_remote(path) else path
    try:
      parquet_file = pq.ParquetFile(source)
    except (pa.ArrowException, OSError) as e:
      raise InputError(f"{path}: not a readable parquet file ({e})") from None
    for group in range(parquet_file.num_row_groups):
      for row in parquet_file.read_row_group(group).to_pylist():
        row_number += 1
        yield row_number, row


def _read_tfds(spec: str) -> Iterator[tuple[int, Any]]:
  """Rows of `tfds:NAME/SPLIT` (SPLIT defaults to train), bytes decoded to str."""
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise ImportError(f"{spec}: TFDS inputs need tensorflow-datasets (pip install "
                      "'seedrl[tfds]'); jsonl and parquet files do not") from e
  name, _, split = spec[len(TFDS_PREFIX):].partition("/")
  dataset = tfds.load(name, split=split or "train")

  def decode(value):
    if isinstance(value, bytes):
      return value.decode("utf-8")
    return value.tolist() if hasattr(value, "tolist") else value

  for row_number, row in enumerate(tfds.as_numpy(dataset), start=1):
    yield row_number, {key: decode(value) for key, value in row.items()}


def _expand(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[str]:
  """Files named by `paths`: plain paths, glob patterns (sorted matches) and `tfds:` specs."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  files = []
  for path in map(str, paths):
    if path.startswith(TFDS_PREFIX):
      files.append(path)
    elif storage.is_remote(path):
      files.extend(_expand_remote(path))
    elif glob.has_magic(path):
      matches = sorted(glob.glob(path))
      if not matches:
        raise FileNotFoundError(f"no file matches {path}")
      files.extend(matches)
    elif not os.path.isfile(path):
      raise FileNotFoundError(f"prompt file not found: {path}")
    else:
      files.append(path)
  return files


def _expand_remote(path: str) -> list[str]:
  """The files a remote path or glob names (sorted matches), through etils.epath."""
  if not glob.has_magic(path):
    if not epath.Path(path).exists():
      raise FileNotFoundError(f"prompt file not found: {path}")
    return [path]
  scheme, _, rest = path.partition("://")
  bucket, _, pattern = rest.partition("/")
  matches = sorted(os.fspath(p) for p in epath.Path(f"{scheme}://{bucket}").glob(pattern))
  if not matches:
    raise FileNotFoundError(f"no file matches {path}")
  return matches


def _fixed_prefix(path: str) -> str:
  """`path` up to the folder of its first glob character (the path itself without one)."""
  if not glob.has_magic(path):
    return path
  fixed = []
  for part in path.split("/"):
    if glob.has_magic(part):
      break
    fixed.append(part)
  return "/".join(fixed)


def check_files(paths: str, field: str) -> None:
  """The comma-separated `paths` of config.<field> (as config.data.train_files holds them) name
  files that exist and hold records: InputError naming the field when it is empty, a path or
  glob finds nothing, a file is empty, or the storage of a remote path does not answer within
  seconds (rl/core/storage.py preflight). Run at start (rl/config/validation.py check_paths),
  before any model is built."""
  if not paths:
    raise InputError(f"config.{field} is empty: config.data.source='files' reads prompt records "
                     "from it; set it to jsonl/parquet paths or globs (comma-separated)")
  for path in paths.split(","):
    storage.preflight(_fixed_prefix(path), f"config.{field}")
  try:
    files = _expand(paths.split(","))
  except FileNotFoundError as e:
    raise InputError(f"config.{field}={paths!r}: {e}") from None
  for path in files:
    if not _has_rows(path):
      raise InputError(f"config.{field}={paths!r}: {path} holds no prompt records")


def _has_rows(path: str) -> bool:
  """Whether a jsonl file has a non-blank line, or a parquet file a row (from its footer);
  other inputs are not opened here (their reader reports them)."""
  suffix = pathlib.Path(path).suffix.lower()
  if suffix == ".jsonl":
    with (epath.Path(path).open("rb") if "://" in path else open(path, "rb")) as f:
      return any(line.strip() for line in f)
  if suffix == ".parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
      return pq.ParquetFile(path).metadata.num_rows > 0
    except (pa.ArrowException, OSError) as e:
      raise InputError(f"{path}: not a readable parquet file ({e})") from None
  return True


def _rows(path: str) -> tuple[Iterator[tuple[int, Any]], str, str]:
  """(rows, default data_source, how a row is located in messages) for one input."""
  if path.startswith(TFDS_PREFIX):
    return _read_tfds(path), path[len(TFDS_PREFIX):].partition("/")[0], "row"
  suffix = pathlib.Path(path).suffix.lower()
  stem = pathlib.Path(path).stem
  if suffix == ".jsonl":
    return _read_jsonl(path), stem, "line"
  if suffix == ".parquet":
    return _read_parquet(path), stem, "row"
  raise InputError(f"{path}: unsupported prompt file type {suffix!r} (use .jsonl or .parquet)")


def load_records(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                 skip_bad: bool = False,
                 parse: Callable[..., Any] = normalize_record) -> tuple[list[Any], LoadStats]:
  """Reads and normalises every row of `paths`, in order.

  `paths`: file paths (.jsonl, .parquet), glob patterns, or `tfds:NAME/SPLIT`.
  A malformed row raises InputError("PATH:LINE: reason") (parquet/TFDS: "PATH row N: reason");
  with `skip_bad` it is skipped, counted in the returned stats and logged. `parse(row,
  default_source=)` turns a raw row into what is returned, raising ValueError on a bad one:
  prompt records by default (`normalize_record`); rl/jobs/preference.py reads preference pairs
  through it.
  """
  records: list[Any] = []
  stats = LoadStats()
  for path in _expand(paths):
    rows, default_source, unit = _rows(path)
    loaded = skipped = 0
    for number, row in rows:
      where = f"{path}:{number}" if unit == "line" else f"{path} row {number}"
      try:
        if isinstance(row, ValueError):
          raise row
        records.append(parse(row, default_source=default_source))
        stats.locations.append(where)
        loaded += 1
      except ValueError as e:
        if not skip_bad:
          raise InputError(f"{where}: {e}") from None
        skipped += 1
        if skipped <= MAX_LOGGED_BAD_ROWS:
          logging.warning("skipping bad row %s: %s", where, e)
    if skipped:
      logging.warning("%s: skipped %d bad record(s), kept %d", path, skipped, loaded)
    stats.loaded += loaded
    stats.skipped += skipped
    stats.loaded_by_file[path] = loaded
    stats.skipped_by_file[path] = skipped
  return records, stats
