"""The XManager image recipe (launch/xm_launch.py docker_instructions) builds what a job runs:
the locked requirements, and the client libraries of a gs:// workdir."""

import os
import shlex

from launch import xm_launch
from rl.jobs import checkpoint

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _steps(accelerator: str) -> list[tuple[str, list[str]]]:
  return [(line.split()[0], shlex.split(line)[1:])
          for line in xm_launch.docker_instructions(accelerator, os.path.basename(ROOT))]


def test_every_pip_install_is_held_to_the_lock_file_copied_before_it():
  """requirements.lock is copied into the image before any install, and every pip install is
  constrained by it (the versions setup.sh installs and CI tests), the requirements included."""
  copied = set()
  installs = []
  for op, args in _steps("tpu_v5p"):
    if op == "COPY":
      sources, dest = args[:-1], args[-1]
      for source in sources:
        assert os.path.exists(os.path.join(os.path.dirname(ROOT), source)), source
        copied.add(os.path.join(dest, os.path.basename(source.rstrip("/"))))
    elif op == "RUN" and "install" in args:
      assert args[args.index("-c") + 1] == "/seedrl/requirements.lock" in copied, args
      installs.append(args)
  assert any(a[a.index("-r") + 1] == "/seedrl/requirements.txt" for a in installs if "-r" in a)


def test_image_holds_the_client_libraries_of_a_gs_workdir():
  """For each module a gs:// workdir needs (rl/jobs/checkpoint.py GS_MODULES), one choice is
  installed, on TPU and GPU images alike."""
  for accelerator in ("tpu_v5p", "a100"):
    packages = {word for op, args in _steps(accelerator) if op == "RUN" for word in args}
    provided = {p.replace("-", ".") for p in packages}
    for choices in checkpoint.GS_MODULES:
      assert choices & provided, (choices, accelerator)
