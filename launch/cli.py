"""What the launch scripts' mains share on the command line: the words absl leaves after the
flags (none of the scripts takes any), and the --config file a run is checked by and named
after."""

import os
import re

from absl import app, flags

from rl.config.validation import validate
from rl.core.checks import InputError


def no_arguments(argv: list[str]) -> None:
  """Refuses the words absl passes to main after the flags (argv[1:]): no launch script takes
  positional arguments, so one is a mistyped flag, reported rather than ignored."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")


def checked_config(config):
  """The --config flag's ConfigDict, validated (rl/config/validation.py `validate`); a usage error
  when the flag was not given."""
  if config is None:
    raise app.UsageError("--config=configs/<name>.py is required")
  validate(config)
  return config


def check_workdir(workdir: str) -> None:
  """A local --workdir is a directory or can become one: InputError naming the flag when it,
  or the nearest of its parent folders that exists, is a file. Remote workdirs are not
  looked at here."""
  if "://" in workdir:
    return
  path = os.path.abspath(workdir)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  if not os.path.isdir(path):
    where = "is a file" if path == os.path.abspath(workdir) else f"is inside the file {path}"
    raise InputError(f"--workdir={workdir} {where}: it must be a directory (or not exist yet)")


def run_name(config_arg: str) -> str:
  """A --config value as a run's name: the file's name without its folder and .py, then the
  variant after ":" if any (configs/demo.py -> "demo", configs/demo.py:grpo_v32 ->
  "demo_grpo_v32"), characters other than letters, digits, "." and "-" in the variant as "_".
  Variants of one file are different runs, so they get different default workdirs."""
  path, _, variant = config_arg.partition(":")
  name = os.path.splitext(os.path.basename(path))[0]
  return f"{name}_{re.sub(r'[^A-Za-z0-9.-]', '_', variant)}" if variant else name


def config_name() -> str:
  """The --config flag's run_name: the default workdir of a run (workdir/<name>) and the title of
  its job."""
  return run_name(flags.FLAGS["config"].config_filename)
