"""Console logging and error reporting shared by the launch scripts: this project's INFO
progress lines, and warnings or errors from anywhere; library INFO chatter (orbax logs every
checkpoint operation) is dropped. Bad input (a config file that does not load, an unknown or
malformed --config override, a bad value, a missing file or a broken checkpoint) is printed as
one line `error: ...` with exit status 2, not as a traceback."""

import logging as pylogging
import os
import sys
from collections.abc import Callable

from absl import app, flags, logging

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_INPUT_STATUS = 2


def _only_project_info(record) -> bool:
  return record.levelno >= pylogging.WARNING or record.pathname.startswith(_ROOT)


def setup() -> None:
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_only_project_info)


def one_line(error: BaseException) -> str:
  """The message of `error` on one line. ml_collections wraps an unknown field in
  AttributeError(KeyError(text)), whose str() is a quoted repr (unwrapped to the text), and an
  error raised by a config file's get_config() in a message holding its traceback (whose last
  line is the error)."""
  while error.args and isinstance(error.args[0], BaseException):
    error = error.args[0]
  text = str(error.args[0] if isinstance(error, KeyError) and error.args else error)
  if "Error whilst parsing config file" in text:
    text = text.strip().splitlines()[-1]
  return " ".join(text.split())


def fail(error: BaseException) -> None:
  print(f"error: {one_line(error)}", file=sys.stderr)
  sys.exit(BAD_INPUT_STATUS)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, plus loading the --config file (ml_collections loads it lazily, so a
  missing file would otherwise surface as a traceback inside main)."""
  try:
    rest = flags.FLAGS(argv)
    if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
      flags.FLAGS["config"].value.keys()  # a file that failed to load raises here
    return rest
  except Exception as e:  # noqa: BLE001  (any flag or config-file error is the user's input)
    fail(e)


def run(main: Callable[[list[str]], None], bad_input: tuple[type[BaseException], ...]) -> None:
  """app.run(main) with this project's logging; `bad_input` exceptions raised by main (and any
  error in the flags or the config file) end the program with one line and status 2."""
  setup()

  def guarded(argv):
    try:
      main(argv)
    except bad_input as e:
      fail(e)

  app.run(guarded, flags_parser=_parse_flags)
