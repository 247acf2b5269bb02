"""Fills the `${VAR}` variables of a JobSet template in launch/gke/, checks the job, and prints
the manifest.

  python launch/gke/render.py launch/gke/jobset_tpu.yaml NAME=v32-small IMAGE=<image> \
      WORKDIR=gs://<bucket>/v32-small TPU_ACCELERATOR=tpu-v5p-slice TPU_TOPOLOGY=4x4x2 HOSTS=8 \
      CHIPS_PER_HOST=4 MAX_RESTARTS=3 DATA_PVC=<claim> \
      -- --config=configs/deepseek_v32_moe_tpu.py:small --config.train.steps=200 \
         --config.data.train_files='gs://<bucket>/prompts/*.parquet' \
    | kubectl apply -f -

Values are `NAME=value` pairs; everything after `--` is the training command line, whose
`--config` flags become the container's arguments exactly as launch/xm_launch.py passes them
(`TRAIN_ARGS`, with `--workdir=$WORKDIR`). A variable without a value, or a value no
template variable uses, is an error naming them. Before printing, the job is checked, each
failure one line naming the culprit:

* the config is built from the command and validated as launch/train.py validates it;
* the pods match the accelerator: a TPU slice's chip count (TPU_TOPOLOGY) over the chips of one
  host of its generation gives HOSTS and CHIPS_PER_HOST; a fixed config.mesh must fit the job's
  chips or GPUs (NODES x GPUS_PER_NODE);
* the local paths the job reads (prompt files, tokenizer, HF or orbax checkpoint) reach the
  pods: a path inside the repository is in the image (/seedrl), a gs:// one is read through
  etils.epath, and any other needs DATA_PVC=<claim>, a PersistentVolumeClaim holding them at the
  same paths, mounted read-only at each of their top folders (/data, /models, ...); without it
  they are refused. The pods get this machine's $SEEDRL_EVAL_DIR, so the held-out sets a config
  names resolve to the paths checked here.

GRACE_SECONDS (the pods' terminationGracePeriodSeconds) defaults to `grace_seconds`: a SIGTERM
lets the step in progress finish and saves a checkpoint, and the worst case is a SIGTERM during
the first step, which compiles.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import sys
from typing import Mapping, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

if __name__ == "__main__":  # a script, before jax is imported (not when tests import it)
  from launch import platforms
  platforms.settle()

import ml_collections  # noqa: E402
import yaml  # noqa: E402
from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import cli, logs  # noqa: E402
from launch.xm_launch import REPO_ROOT, build_args, check_mesh, read_paths  # noqa: E402
from models.transformer import param_counts  # noqa: E402
from rl.core.policy import model_config  # noqa: E402
from rl.data import EVAL_DIR  # noqa: E402

TEMPLATE_VARIABLE = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")
IMAGE_REPO = "/seedrl"  # where the image holds the repository (xm_launch.docker_instructions)

# Chips one TPU VM of each GKE accelerator holds in a multi-host slice; v5e and v6e slices of up
# to 8 chips (1x1, 2x2, 2x4) are one VM holding them all (GKE's TPU topology tables).
TPU_CHIPS_PER_HOST = {"tpu-v4-podslice": 4, "tpu-v5p-slice": 4, "tpu-v5-lite-podslice": 4,
                      "tpu-v6e-slice": 4}
TPU_SINGLE_HOST_CHIPS = {"tpu-v5-lite-podslice": 8, "tpu-v6e-slice": 8}

# terminationGracePeriodSeconds = the first step's compile + one checkpoint save + a margin.
# Compile: the longest measured in docs/performance.md (Qwen3-30B-A3B, update 580 s + rollout
# 501 s, compiled ahead of time on a 2-core CPU host; a TPU VM's CPUs are faster), rounded up.
FIRST_COMPILE_S = 1200
# Save: fp32 master weights and AdamW's two fp32 moments per parameter, split over the hosts,
# written at an assumed 100 MB/s per host (a conservative figure for GCS, not measured here).
STATE_BYTES_PER_PARAM = 12
SAVE_BYTES_PER_S_PER_HOST = 100e6
# Margin: the rest of the step in progress (rollout and update) and the pod's shutdown.
GRACE_MARGIN_S = 300


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


def train_args(command: Sequence[str], workdir: str) -> list[str]:
  """The container's `args:` for a training command line."""
  return build_args(["train.py", *command], workdir=workdir)


def job_config(args: Sequence[str]) -> ml_collections.ConfigDict:
  """The config the job's launch/train.py builds from `args` (train_args), validated as it
  validates it (launch/cli.py checked_config); ValueError with its one-line message."""
  in_repo = ["train.py"] + [f"--config={os.path.join(REPO_ROOT, a.partition('=')[2])}"
                            if a.startswith("--config=") else a
                            for a in args if not a.startswith("--workdir=")]
  flag_values = flags.FlagValues()
  # The override flags (--config.a.b) are defined from the command line it is given.
  config_flags.DEFINE_config_file("config", None, "", flag_values=flag_values, lock_config=True,
                                  sys_argv=in_repo)
  try:
    flag_values(in_repo)
    return cli.checked_config(flag_values.config)
  except Exception as e:  # noqa: BLE001  (a flag, config-file or validation error: the input)
    raise ValueError(logs.one_line(e)) from None


def tpu_hosts(accelerator: str, topology: str) -> tuple[int, int]:
  """(hosts, chips per host) of a GKE TPU slice, e.g. ("tpu-v5p-slice", "4x4x2") -> (8, 4)."""
  if accelerator not in TPU_CHIPS_PER_HOST:
    raise ValueError(f"TPU_ACCELERATOR={accelerator}: not one of "
                     f"{', '.join(sorted(TPU_CHIPS_PER_HOST))}")
  if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*){1,2}", topology):
    raise ValueError(f"TPU_TOPOLOGY={topology}: expected AxB or AxBxC chips (e.g. 4x4x2)")
  chips = math.prod(int(n) for n in topology.split("x"))
  if chips <= TPU_SINGLE_HOST_CHIPS.get(accelerator, 0):
    return 1, chips
  per_host = TPU_CHIPS_PER_HOST[accelerator]
  if chips % per_host:
    raise ValueError(f"TPU_TOPOLOGY={topology}: {chips} chips do not fill hosts of {per_host} "
                     f"on {accelerator}")
  return chips // per_host, per_host


def _positive(values: Mapping[str, str], name: str) -> int:
  value = values[name]
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"{name}={value}: expected a positive integer")
  return int(value)


def check_accelerators(values: Mapping[str, str], names: Sequence[str]) -> int:
  """Checks the pod count against the TPU topology (or the GPU values); returns the job's
  device count (chips or GPUs)."""
  if "TPU_TOPOLOGY" in names:
    hosts, per_host = tpu_hosts(values["TPU_ACCELERATOR"], values["TPU_TOPOLOGY"])
    given = (_positive(values, "HOSTS"), _positive(values, "CHIPS_PER_HOST"))
    if given != (hosts, per_host):
      raise ValueError(
          f"HOSTS={given[0]} CHIPS_PER_HOST={given[1]} do not match TPU_TOPOLOGY="
          f"{values['TPU_TOPOLOGY']} on {values['TPU_ACCELERATOR']}: {hosts * per_host} chips, "
          f"{per_host} per host, so HOSTS={hosts} CHIPS_PER_HOST={per_host}")
    return hosts * per_host
  return _positive(values, "NODES") * _positive(values, "GPUS_PER_NODE")


def grace_seconds(config: ml_collections.ConfigDict, hosts: int) -> int:
  """terminationGracePeriodSeconds for the job (see the constants above)."""
  state_bytes = param_counts(model_config(config))["total"] * STATE_BYTES_PER_PARAM
  save_s = math.ceil(state_bytes / hosts / SAVE_BYTES_PER_S_PER_HOST)
  return FIRST_COMPILE_S + save_s + GRACE_MARGIN_S


def mount_paths(pod: dict, paths: Sequence[tuple[str, str]], claim: str | None) -> None:
  """Mounts `claim` read-only at the top folder of every absolute path (subPath: the same
  folder inside the claim); ValueError naming the first one when no claim is given, or a
  relative path (the pods' working directory is the image's repository) that the repository
  does not hold."""
  for field, path in paths:
    if not os.path.isabs(path) and not glob.glob(os.path.join(REPO_ROOT, path)):
      raise ValueError(f"config.{field}={path!r}: not in the repository, which is all the "
                       f"image holds at {IMAGE_REPO}")
  outside = [(field, path) for field, path in paths if os.path.isabs(path)]
  if not outside:
    return
  if not claim:
    field, path = outside[0]
    raise ValueError(
        f"config.{field}={path!r}: a path on this machine, which the pods do not have; put it on "
        "gs:// or in the repository (copied into the image), or pass DATA_PVC=<claim>, a "
        "PersistentVolumeClaim holding it at the same path")
  tops = sorted({path.lstrip("/").split("/")[0] for _, path in outside})
  pod.setdefault("volumes", []).append(
      {"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
  (container,) = pod["containers"]
  container.setdefault("volumeMounts", []).extend(
      {"name": "data", "mountPath": f"/{top}", "subPath": top, "readOnly": True} for top in tops)


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
  names = template_variables(template)
  # TRAIN_ARGS comes from the command after "--" and WORKDIR; GRACE_SECONDS has a default.
  wanted = sorted(set(names) - {"TRAIN_ARGS", "GRACE_SECONDS"} | {"WORKDIR"})
  missing = [n for n in wanted if n not in values]
  if missing:
    raise ValueError(f"no value for {', '.join(missing)} (pass NAME=value; needed: "
                     f"{', '.join(wanted)})")
  args = train_args(command, values.pop("WORKDIR"))
  claim = values.pop("DATA_PVC", None)
  config = job_config(args)
  devices = check_accelerators(values, names)
  check_mesh(config, devices)
  hosts = int(values.get("HOSTS") or values["NODES"])
  values.setdefault("GRACE_SECONDS", str(grace_seconds(config, hosts)))
  values["TRAIN_ARGS"] = json.dumps(args)  # a JSON list is a YAML flow list
  doc = yaml.safe_load(render(template, values))
  for job in doc["spec"]["replicatedJobs"]:
    pod = job["template"]["spec"]["template"]["spec"]
    mount_paths(pod, read_paths(config), claim)
    for container in pod["containers"]:  # held-out sets at the paths checked here
      container["env"].append({"name": "SEEDRL_EVAL_DIR", "value": EVAL_DIR})
  return yaml.safe_dump(doc, sort_keys=False)


if __name__ == "__main__":
  try:
    print(main(sys.argv))
  except ValueError as e:
    print(f"render.py: {e}", file=sys.stderr)
    sys.exit(2)
