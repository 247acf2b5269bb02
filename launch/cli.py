"""What the launch scripts' mains share on the command line: the words absl leaves after the
flags (none of the scripts takes any), the --config file a run is checked by and named after,
its workdir, and the help that lists the config's fields."""

import os
import re
import sys

from absl import app, flags

from models.sharding import MESH_AXES
from rl.config.defaults import base_config
from rl.config.describe import field_notes, leaves
from rl.config.validation import validate
from rl.core.checks import InputError


def define(definer, name: str, *args, **kwargs):
  """`definer(name, ...)` (flags.DEFINE_string, config_flags.DEFINE_config_file, ...) for a flag
  that several launch scripts define, each with its own meaning (--config, --mesh, --seed...).
  The first definition in a process takes the command line; a later one, from another script
  imported beside it (tests import helpers of several scripts into one process), goes on a
  FlagValues of its own, which nothing parses, instead of failing absl's duplicate check."""
  if name in flags.FLAGS:
    kwargs["flag_values"] = flags.FlagValues()
  return definer(name, *args, **kwargs)


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


def format_config(config) -> str:
  """The resolved config as `name=value` lines, one per field (the --config.<name>=<value> of
  each), in the config's order."""
  return "\n".join(f"{name}={value!r}" for name, value in leaves(config).items())


def config_help() -> str:
  """The config's sections and fields with their defaults and one-line meanings
  (rl/config/describe.py field_notes): what --help prints after the flags."""
  notes = field_notes()
  fields = leaves(base_config())
  lines = ["Config fields (--config.<field>=<value> sets one; a config file starts from these "
           "defaults of rl/config/defaults.py base_config; --print_config shows a config's):"]
  shown = set()
  for name, value in sorted(fields.items(), key=lambda item: "." in item[0]):
    parts = name.split(".")
    for depth in range(1, len(parts)):
      section = ".".join(parts[:depth])
      if section not in shown:
        shown.add(section)
        lines.append(f"\n{'  ' * (depth - 1)}{section}: {notes.get(section, '')}".rstrip())
    note = f"  {notes[name]}" if name in notes else ""
    lines.append(f"{'  ' * len(parts)}{name}={value!r}{note}")
  return "\n".join(lines)


class _HelpFlag(flags.BooleanFlag):
  """absl's help flag, printing the config fields after the flags and exiting with status 0."""

  def __init__(self, name: str, short_name: str | None, full: bool):
    super().__init__(name, False, "show the " + ("full " if full else "") + "help, the config "
                     "fields included, and exit", short_name=short_name, allow_hide_cpp=True)
    self.full = full

  def parse(self, argument) -> None:
    super().parse(argument)
    if self.value:
      app.usage(shorthelp=not self.full, writeto_stdout=True)
      print()
      print(config_help())
      sys.exit(0)


def define_help_flags() -> None:
  """Replaces absl's --help (-?), --helpshort and --helpfull, which list no config field and
  exit with status 1, by ones that list them and exit with status 0. Call it once the script's
  flags are defined (absl defines its own help flags only once, so app.run keeps these)."""
  app.define_help_flags()
  for name in ("help", "?", "helpshort", "helpfull"):
    delattr(flags.FLAGS, name)
  for name, short_name, full in (("help", "?", False), ("helpshort", None, False),
                                 ("helpfull", None, True)):
    flags.DEFINE_flag(_HelpFlag(name, short_name, full))


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
