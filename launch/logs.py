"""Console logging and error reporting shared by the launch scripts: this project's INFO
progress lines, and warnings or errors from anywhere; library INFO chatter (orbax logs every
checkpoint operation) is dropped, told apart by the name of the module that logged, not by
where its file lies (a virtual environment inside the checkout holds library files too). Bad
input (a config file that does not load, an unknown or malformed --config override, a bad
value, a missing file or a broken checkpoint) is printed as one line `error: ...` with exit
status 2, not as a traceback."""

import functools
import logging as pylogging
import sys
from collections.abc import Callable

from absl import app, flags, logging

BAD_INPUT_STATUS = 2
# This project's top-level packages (pyproject.toml), and the script being run.
PROJECT_MODULES = ("launch", "configs", "rl", "models", "kernels", "__main__")


@functools.lru_cache(maxsize=None)
def _module_of_file(pathname: str) -> str:
  """The name of the imported module whose source is `pathname` ("" for none)."""
  for name, module in list(sys.modules.items()):
    if getattr(module, "__file__", None) == pathname:
      return name
  return ""


def source_module(record: pylogging.LogRecord) -> str:
  """The name of the module that logged `record`. absl.logging (used by this project, orbax and
  most JAX libraries) logs every caller through the one logger "absl", whose record names the
  caller's file: that file's module. Any other logger is named after its module
  (logging.getLogger(__name__)), as the standard library's convention goes."""
  if record.name != logging.get_absl_logger().name:
    return record.name
  return _module_of_file(record.pathname)


def is_project_module(name: str) -> bool:
  return name.partition(".")[0] in PROJECT_MODULES


def _only_project_info(record: pylogging.LogRecord) -> bool:
  return record.levelno >= pylogging.WARNING or is_project_module(source_module(record))


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
