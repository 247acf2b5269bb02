"""The console filter of the launch scripts (launch/logs.py): library INFO is dropped by the
name of the module that logged it, wherever its file lies; this project's INFO and anyone's
warnings pass."""

import logging as pylogging
import os
import sys
import types

from launch import logs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _record(logger: str, level: int, pathname: str) -> pylogging.LogRecord:
  return pylogging.LogRecord(logger, level, pathname, 1, "msg", (), None)


def _library_in_checkout(monkeypatch, name: str) -> str:
  """A module `name` imported from a virtual environment inside the checkout (the common
  `.venv`); returns its file."""
  path = os.path.join(ROOT, ".venv", "lib", "python3.11", "site-packages",
                      *name.split(".")) + ".py"
  module = types.ModuleType(name)
  module.__file__ = path
  monkeypatch.setitem(sys.modules, name, module)
  return path


def test_library_info_is_dropped_even_from_a_venv_inside_the_checkout(monkeypatch):
  """orbax INFO, whether through its own logger or through absl.logging from a file under the
  checkout's .venv, does not reach the console."""
  path = _library_in_checkout(monkeypatch, "orbax.checkpoint._venv_probe")
  assert path.startswith(ROOT)
  assert not logs._only_project_info(_record("orbax.checkpoint", pylogging.INFO, path))
  assert not logs._only_project_info(_record("absl", pylogging.INFO, path))


def test_project_info_and_library_warnings_pass(monkeypatch):
  """This project's INFO lines (absl.logging from rl/..., or a logger named after a project
  module) pass; a library's WARNING and ERROR pass too."""
  from rl.jobs import trainer
  assert logs._only_project_info(_record("absl", pylogging.INFO, trainer.__file__))
  assert logs._only_project_info(_record("rl.jobs.trainer", pylogging.INFO, "/elsewhere.py"))
  path = _library_in_checkout(monkeypatch, "orbax.checkpoint._venv_probe_warning")
  for level in (pylogging.WARNING, pylogging.ERROR):
    assert logs._only_project_info(_record("absl", level, path))
    assert logs._only_project_info(_record("orbax.checkpoint", level, path))
