"""What the launch scripts' mains share on the command line: the words absl leaves after the
flags (none of the scripts takes any), and the --config file a run is checked by and named
after."""

import os

from absl import app, flags

from models.sharding import MESH_AXES
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


def config_name() -> str:
  """The --config file's name without its folder and .py (configs/demo.py:vapo -> "demo"): the
  default workdir of a run and the title of its job."""
  return os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0]


def mesh_shape(flag: str, spec: str) -> dict[str, int]:
  """A --mesh flag's "axis=size,..." (one size may be -1: the devices left over) as a dict;
  an InputError naming the flag and the bad part."""
  shape = {}
  for part in spec.split(","):
    axis, _, size = part.partition("=")
    if axis not in MESH_AXES or not size.lstrip("-").isdigit():
      raise InputError(f"--{flag}={spec}: {part!r} is not axis=size with an axis of "
                           f"{', '.join(MESH_AXES)}")
    shape[axis] = int(size)
  return shape
