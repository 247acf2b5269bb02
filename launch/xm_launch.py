"""Submits launch/train.py to a Cloud TPU slice (or GPUs) through XManager.

  xmanager launch launch/xm_launch.py -- --config=configs/deepseek_v32_moe_tpu.py:small \
      --config.train.steps=200 --accelerator=tpu_v5p=4x4x2 --workdir=gs://<bucket>/v32-small

Every `--config=...` / `--config.a.b=v` flag is checked here first (the config is built and
validated before anything is submitted) and handed unchanged, in order, to launch/train.py in
the job (`build_args`). The job's processes join one JAX runtime through rl/parallel/distributed.py
(Vertex AI's CLUSTER_SPEC, or the TPU VM environment that jax detects itself).

XManager is not a dependency of this project: it is imported in main() only, on the machine that
launches (`pip install xmanager`). `--accelerator` names an XManager resource and its count or
topology (`tpu_v5p=8x8x4`, `a100=8`); which names exist depends on the installed release.
"""

from __future__ import annotations

import glob
import math
import os
import re
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import cli  # noqa: E402
from rl.config.validation import TOKENIZERS_BUILTIN  # noqa: E402
from rl.core import storage  # noqa: E402
from rl.jobs.checkpoint import GS_PACKAGES  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAX_VERSION = "0.10.2"

_CONFIG = cli.define(config_flags.DEFINE_config_file, "config", None, "Config file (configs/*.py[:arg]).",
                                          lock_config=True)
_WORKDIR = cli.define(flags.DEFINE_string, "workdir", None, "Output directory of the job (e.g. gs://...).")
_ACCELERATOR = flags.DEFINE_string("accelerator", "tpu_v5p=8x8x4",
                                   "XManager resource and count or topology, e.g. "
                                   "tpu_v5p=8x8x4 or a100=8.")
_NAME = flags.DEFINE_string("name", None, "Experiment title (default: the config's name).")
_BASE_IMAGE = flags.DEFINE_string("base_image", "python:3.11", "Docker base image of the job.")
_EXECUTOR = flags.DEFINE_enum("executor", "vertex", ["vertex", "kubernetes"],
                              "XManager local-backend executor.")

_CONFIG_PATH = re.compile(r"^(?P<path>.*?\.py)(?P<arg>:.*)?$")


def _is_config_flag(name: str) -> bool:
  return name in ("--config", "-config") or name.startswith(("--config.", "--noconfig.",
                                                              "-config.", "-noconfig."))


def _relative_config(value: str, repo_root: str) -> str:
  """A config path as the job sees it: relative to the repository root (its working dir)."""
  match = _CONFIG_PATH.match(value)
  if not match:
    raise ValueError(f"--config={value!r}: expected a configs/<name>.py[:arg] file")
  path = os.path.abspath(match["path"])
  root = os.path.abspath(repo_root)
  if os.path.commonpath([path, root]) != root:
    raise ValueError(f"--config={value!r} is outside the repository {root}; the job only has "
                     "the repository's files")
  return os.path.relpath(path, root) + (match["arg"] or "")


def build_args(argv: Sequence[str], *, workdir: str, repo_root: str = REPO_ROOT) -> list[str]:
  """The job's launch/train.py arguments: every config flag of `argv` (a command line, program
  name first) in its original order, the config file path made relative to the repository,
  then `--workdir`. Other flags (this launcher's own) are dropped."""
  args: list[str] = []
  i = 1
  while i < len(argv):
    token = argv[i]
    name, has_value, value = token.partition("=")
    if _is_config_flag(name):
      takes_next = (not has_value and not name.lstrip("-").startswith("noconfig.")
                    and i + 1 < len(argv) and not argv[i + 1].startswith("--"))
      if name.lstrip("-") == "config":
        if not has_value and not takes_next:
          raise ValueError("--config needs a value: --config=configs/<name>.py")
        value = value if has_value else argv[i + 1]
        args.append(f"--config={_relative_config(value, repo_root)}")
        i += 1 if has_value else 2
        continue
      args.append(token)
      if takes_next:  # the "--config.a.b value" form
        args.append(argv[i + 1])
        i += 1
    i += 1
  if not any(a.startswith("--config=") for a in args):
    raise ValueError("--config=configs/<name>.py is required")
  if not workdir:
    raise ValueError("--workdir is required (where the job writes checkpoints and metrics)")
  return args + [f"--workdir={workdir}"]


def docker_instructions(accelerator: str, repo_dir: str) -> list[str]:
  """Image build steps: the requirements at the versions of requirements.lock (every
  transitive dependency pinned, as launch/setup.sh installs them), jax for the accelerator, the
  client libraries a gs:// workdir needs (rl/jobs/checkpoint.py GS_PACKAGES), then the
  repository (its directory as the job's working directory)."""
  extra = "tpu" if accelerator.lower().startswith("tpu") else "cuda12"
  pip = "RUN python -m pip install --no-cache-dir -c /seedrl/requirements.lock"
  return [
      f"COPY {repo_dir}/requirements.txt {repo_dir}/requirements.lock /seedrl/",
      f"{pip} -r /seedrl/requirements.txt",
      f'{pip} "jax[{extra}]=={JAX_VERSION}"',
      f"{pip} {' '.join(GS_PACKAGES)}",
      f"COPY {repo_dir}/ /seedrl",
      "WORKDIR /seedrl",
  ]


def check_mesh(config: ml_collections.ConfigDict, devices: int) -> None:
  """config.mesh on the job's `devices` chips or GPUs, as rl/parallel/placement.py builds it:
  the fixed axes (and DCN factors) must fit, and a -1 axis must divide what is left."""
  if config.mesh.auto:
    return
  used = config.mesh.devices or devices
  if used > devices:
    raise ValueError(f"config.mesh.devices={used}: the job has {devices} devices")
  ici = dict(config.mesh.shape)
  fixed = math.prod(n for n in ici.values() if n != -1) * math.prod(config.mesh.dcn.values())
  layout = f"config.mesh.shape={ici} dcn={dict(config.mesh.dcn)}"
  if -1 in ici.values() and used % fixed:
    raise ValueError(f"{layout}: {used} devices do not split into the fixed axes ({fixed})")
  if -1 not in ici.values() and fixed != used:
    raise ValueError(f"{layout} spans {fixed} devices; the job has {used}")


def read_paths(config: ml_collections.ConfigDict) -> list[tuple[str, str]]:
  """(field, path) of every file or folder the job reads at start, local ones only."""
  fields = [("init_checkpoint", config.init_checkpoint), ("init_hf_dir", config.init_hf_dir)]
  if config.tokenizer not in TOKENIZERS_BUILTIN:
    fields.append(("tokenizer", config.tokenizer))
  if config.data.source == "files":
    if not config.data.train_files:
      raise ValueError("config.data.train_files is empty: config.data.source='files' reads "
                       "prompt records from it")
    fields += [(f"data.{name}", path) for name in ("train_files", "heldout_files")
               for path in config.data[name].split(",") if path]
  return [(field, path) for field, path in fields if path and not storage.is_remote(path)]


def check_job(config, accelerator: str) -> int:
  """The job's device count from `accelerator` (a TPU topology's chips, or a GPU count), checked
  before submission, as launch/gke/render.py checks a JobSet: config.mesh must span those devices,
  and every local path the job reads must be in the repository (all the image holds: XManager
  mounts no volume here). ValueError on one line naming the culprit."""
  resource, _, quantity = accelerator.partition("=")
  if resource.lower().startswith("tpu"):
    if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*){1,2}", quantity):
      raise ValueError(f"--accelerator={accelerator}: a TPU slice needs its topology, e.g. "
                       "tpu_v5p=8x8x4")
    devices = math.prod(int(n) for n in quantity.split("x"))
  elif not quantity or quantity.isdigit() and int(quantity) > 0:
    devices = int(quantity or 1)
  else:
    raise ValueError(f"--accelerator={accelerator}: expected a positive GPU count, e.g. a100=8")
  check_mesh(config, devices)
  for field, path in read_paths(config):
    if os.path.isabs(path) or not glob.glob(os.path.join(REPO_ROOT, path)):
      raise ValueError(f"config.{field}={path!r}: the job has the repository (its image) and "
                       "gs:// paths only; put it on gs:// or in the repository")
  return devices


def main(argv):
  del argv  # the flags are read from sys.argv by build_args, and parsed by absl
  try:
    from xmanager import xm, xm_local
  except ImportError:
    raise app.UsageError(
        "launch/xm_launch.py needs XManager on the launching machine (pip install xmanager); it "
        "is not a dependency of this project. Without it, launch/gke/ has JobSet manifests for "
        "kubectl.") from None
  try:
    check_job(cli.checked_config(_CONFIG.value), _ACCELERATOR.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  args = build_args(sys.argv, workdir=_WORKDIR.value)
  resource, _, quantity = _ACCELERATOR.value.partition("=")
  try:
    requirements = xm.JobRequirements(**{resource: quantity or 1})
  except (KeyError, ValueError) as e:
    raise app.UsageError(f"--accelerator={_ACCELERATOR.value}: {e} (the resource names come "
                         "from the installed xmanager's xm.ResourceType)") from None
  executor_cls = xm_local.Vertex if _EXECUTOR.value == "vertex" else xm_local.Kubernetes
  executor = executor_cls(requirements=requirements)
  title = _NAME.value or cli.config_name()
  with xm_local.create_experiment(experiment_title=title) as experiment:
    [executable] = experiment.package([xm.python_container(
        executor_spec=executor_cls.Spec(), path=REPO_ROOT, base_image=_BASE_IMAGE.value,
        docker_instructions=docker_instructions(resource, os.path.basename(REPO_ROOT)),
        entrypoint=xm.ModuleName("launch.train"))])
    experiment.add(xm.Job(executable=executable, executor=executor, args=args))
  print(f"submitted {title}: python -m launch.train {' '.join(args)}")


if __name__ == "__main__":
  app.run(main)
