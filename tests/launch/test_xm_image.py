"""The XManager launcher (launch/xm_launch.py): the image recipe builds what a job runs (the
locked requirements, the client libraries of a gs:// workdir), and a job whose mesh or local
paths the accelerator's pods cannot serve is refused before submission."""

import os
import shlex

import ml_collections
import pytest

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


def _config(**mesh) -> ml_collections.ConfigDict:
  from rl.config.defaults import base_config
  c = base_config(preset="tiny_dense", algorithm="dapo")
  c.data.source = "files"
  c.data.train_files = "gs://b/p/*.jsonl"
  c.data.heldout_files = ""
  c.mesh.shape.update(mesh)
  return c


@pytest.mark.parametrize("mesh,accelerator,message", [
    (dict(data=1, fsdp=32), "tpu_v5p=4x4x2", None),
    (dict(data=1, fsdp=32), "tpu_v5p=4x4x1", r"spans 32 devices; the job has 16"),
    (dict(data=-1, fsdp=3), "a100=8", r"8 devices do not split into the fixed axes \(3\)"),
    (dict(data=-1), "tpu_v5p=8", r"a TPU slice needs its topology"),
    (dict(data=-1), "a100=x", r"expected a positive GPU count"),
])
def test_a_mesh_the_accelerator_cannot_hold_is_refused(mesh, accelerator, message):
  """config.mesh must span the devices --accelerator names (a TPU topology's chips or the GPU
  count), as the GKE renderer checks it; a malformed --accelerator is named."""
  config = _config(**mesh)
  if message is None:
    assert xm_launch.check_job(config, accelerator) == 32
    return
  with pytest.raises(ValueError, match=message):
    xm_launch.check_job(config, accelerator)


def test_a_local_path_outside_the_repository_is_refused():
  """The job's image holds the repository only: a prompt file on this machine is refused on
  one line; one inside the repository or on gs:// is accepted."""
  config = _config(data=-1)
  config.data.train_files = "/data/prompts/a.jsonl"
  with pytest.raises(ValueError, match=r"config.data.train_files='/data/prompts/a.jsonl'"):
    xm_launch.check_job(config, "a100=8")
  config.data.train_files = os.path.relpath(__file__, ROOT)
  assert xm_launch.check_job(config, "a100=8") == 8
