"""Fills the `${VAR}` variables of a JobSet template in launch/gke/ and prints the manifest.

  python launch/gke/render.py launch/gke/jobset_tpu.yaml NAME=v32-small IMAGE=<image> \
      WORKDIR=gs://<bucket>/v32-small TPU_ACCELERATOR=tpu-v5p-slice TPU_TOPOLOGY=4x4x2 HOSTS=8 \
      CHIPS_PER_HOST=4 MAX_RESTARTS=3 \
      -- --config=configs/deepseek_v32_moe_tpu.py:small --config.train.steps=200 \
    | kubectl apply -f -

Values are `NAME=value` pairs; everything after `--` is the training command line, whose
`--config` flags become the container's arguments exactly as launch/xm_launch.py passes them
(`TRAIN_ARGS`, with `--workdir=$WORKDIR`). A variable without a value, or a value no
template variable uses, is an error naming them.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Mapping, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from launch.xm_launch import build_args  # noqa: E402

TEMPLATE_VARIABLE = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")


def template_variables(template: str) -> list[str]:
  """The variable names a template uses, sorted."""
  return sorted(set(TEMPLATE_VARIABLE.findall(template)))


def render(template: str, values: Mapping[str, str]) -> str:
  """`template` with every ${NAME} replaced by values[NAME] (no other substitution)."""
  names = template_variables(template)
  missing = [n for n in names if n not in values]
  if missing:
    raise ValueError(f"no value for {', '.join(missing)} (pass NAME=value; the template uses "
                     f"{', '.join(names)})")
  unused = sorted(set(values) - set(names))
  if unused:
    raise ValueError(f"{', '.join(unused)} is not used by the template (it uses "
                     f"{', '.join(names)})")
  return TEMPLATE_VARIABLE.sub(lambda m: str(values[m.group(1)]), template)


def train_args(command: Sequence[str], workdir: str) -> str:
  """The container's `args:` for a training command line (a JSON list is a YAML flow list)."""
  return json.dumps(build_args(["train.py", *command], workdir=workdir))


def main(argv: Sequence[str]) -> str:
  if len(argv) < 2:
    raise SystemExit(__doc__)
  path, rest = argv[1], list(argv[2:])
  command = rest[rest.index("--") + 1:] if "--" in rest else []
  pairs = rest[:rest.index("--")] if "--" in rest else rest
  values = {}
  for pair in pairs:
    name, sep, value = pair.partition("=")
    if not sep:
      raise ValueError(f"{pair!r}: expected NAME=value")
    values[name] = value
  with open(path) as f:
    template = f.read()
  if "TRAIN_ARGS" in template_variables(template):
    # TRAIN_ARGS comes from the command after "--" and WORKDIR.
    wanted = sorted(set(template_variables(template)) - {"TRAIN_ARGS"} | {"WORKDIR"})
    missing = [n for n in wanted if n not in values]
    if missing:
      raise ValueError(f"no value for {', '.join(missing)} (pass NAME=value; needed: "
                       f"{', '.join(wanted)})")
    values["TRAIN_ARGS"] = train_args(command, values.pop("WORKDIR"))
  return render(template, values)


if __name__ == "__main__":
  try:
    print(main(sys.argv))
  except ValueError as e:
    print(f"render.py: {e}", file=sys.stderr)
    sys.exit(2)
