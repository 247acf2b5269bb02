"""Remote paths at run start (rl/core/storage.py) and prompt files on them (rl/data/sources.py):
a storage that does not answer, or missing credentials, fails within seconds on one line naming
the path; gs:// prompt files are found and read through etils.epath, as checkpoints are. No
network here: the gs:// filesystem is a local folder behind epath's backend interface."""

import json
import os
import time

import pytest
from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath

from rl.core import storage
from rl.core.checks import InputError
from rl.data import sources


class FolderAsGcs(epath_backend._OsPathBackend):  # noqa: SLF001
  """gs://bucket/... served from a local folder (the calls epath makes for reading)."""

  def __init__(self, root):
    self.root = str(root)

  def local(self, path):
    return os.path.join(self.root, os.fspath(path).removeprefix("gs://"))

  def exists(self, path):
    return super().exists(self.local(path))

  def isdir(self, path):
    return super().isdir(self.local(path))

  def open(self, path, mode):
    return super().open(self.local(path), mode)

  def glob(self, path):
    return ["gs://" + os.path.relpath(p, self.root) for p in super().glob(self.local(path))]


@pytest.fixture
def gcs(tmp_path, monkeypatch):
  """A bucket `bucket` holding prompts/a.jsonl and prompts/b.jsonl; credentials present."""
  (tmp_path / "bucket" / "prompts").mkdir(parents=True)
  for name, prompt in (("a", "1+1"), ("b", "2+2")):
    (tmp_path / "bucket" / "prompts" / f"{name}.jsonl").write_text(
        json.dumps({"prompt": prompt, "answer": "x"}) + "\n")
  monkeypatch.setitem(gpath._PREFIX_TO_BACKEND, "gs", FolderAsGcs(tmp_path))  # noqa: SLF001
  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
  monkeypatch.setattr(storage, "_google_credentials", lambda: None)
  return tmp_path


def test_gs_prompt_files_are_found_and_read(gcs):
  """A gs:// file and a gs:// glob pass the start-up check and load like local files (the
  file's stem is the data source)."""
  sources.check_files("gs://bucket/prompts/a.jsonl,gs://bucket/prompts/*.jsonl",
                      "data.train_files")
  records, stats = sources.load_records(["gs://bucket/prompts/a.jsonl",
                                         "gs://bucket/prompts/*.jsonl"])
  assert [(r["prompt"], r["data_source"]) for r in records] == [("1+1", "a"), ("1+1", "a"),
                                                                  ("2+2", "b")]
  assert stats.loaded == 3


def test_missing_gs_prompt_file_is_one_line_naming_it(gcs):
  with pytest.raises(InputError, match=r"config.data.train_files=.*gs://bucket/prompts/c.jsonl"):
    sources.check_files("gs://bucket/prompts/c.jsonl", "data.train_files")
  with pytest.raises(InputError, match="no file matches gs://bucket/none/"):
    sources.check_files("gs://bucket/none/*.jsonl", "data.train_files")


def test_storage_that_does_not_answer_fails_within_the_deadline(gcs, monkeypatch):
  """A bucket whose client retries for a minute: the check gives up at its deadline with one
  line naming the path, for a workdir and for prompt files alike."""
  monkeypatch.setattr(FolderAsGcs, "exists", lambda self, path: time.sleep(60))
  t0 = time.monotonic()
  with pytest.raises(InputError, match=r"^--workdir=gs://bucket/run: no answer from the storage "
                                       r"in 1 s") as e:
    storage.preflight(epath.Path("gs://bucket/run"), "--workdir", timeout_s=1.0)
  assert time.monotonic() - t0 < 3 and "\n" not in str(e.value)
  monkeypatch.setattr(storage, "PREFLIGHT_TIMEOUT_S", 1.0)
  with pytest.raises(InputError, match=r"^config.data.train_files=gs://bucket/prompts: no answer"):
    sources.check_files("gs://bucket/prompts/*.jsonl", "data.train_files")


def test_missing_credentials_and_refusals_are_one_line(gcs, monkeypatch):
  """No Google credentials: one line saying so and how to get them, before the storage is
  asked; a storage error (a 403, say) is one line naming the path, not a traceback."""
  class DefaultCredentialsError(Exception):
    pass

  def no_credentials():
    raise DefaultCredentialsError("Your default credentials were not found.")

  asked = []
  monkeypatch.setattr(storage, "_google_credentials", no_credentials)
  monkeypatch.setattr(FolderAsGcs, "exists", lambda self, path: asked.append(path))
  with pytest.raises(InputError, match=r"^--workdir=gs://bucket/run: no usable Google Cloud "
                                       r"credentials .*gcloud auth application-default login"):
    storage.preflight("gs://bucket/run", "--workdir")
  assert not asked

  def forbidden(self, path):
    raise PermissionError("403 caller does not have storage.objects.list access\n  details")

  monkeypatch.setattr(storage, "_google_credentials", lambda: None)
  monkeypatch.setattr(FolderAsGcs, "exists", forbidden)
  with pytest.raises(InputError, match=r"^--workdir=gs://bucket/run: the storage refused "
                                       r"\(PermissionError: 403 caller .* details\)$"):
    storage.preflight("gs://bucket/run", "--workdir")


def test_local_paths_are_not_asked(tmp_path):
  """A local path is the caller's to check (it may not exist yet): nothing is raised."""
  storage.preflight(str(tmp_path / "not-yet"), "--workdir")
