"""Sharding planner CLI: ranks meshes (data x fsdp x expert x tensor), remat policies and
optimiser placements for a training config on N devices of a kind (models/planner.py).

  python launch/plan.py --config=configs/deepseek_v32_moe_tpu.py --devices=256 \
      --device_kind=tpu_v5p
  python launch/plan.py --config=configs/deepseek_v32_moe_tpu.py --devices=8 --device_kind=h100 \
      --remats=none,full --offload_optimizer=both --top=10

Nothing is allocated: parameter sizes come from the abstract model and the logical-axis rules,
the rest from the analytic estimates, which can be off by 2x against the compiler (see
docs/performance.md). `--topology=v5p:4x4x4` defers to the compiler: the best `--verify` plans
are compiled for that TPU slice (update and rollout) and re-ranked by what the compiler says
fits, with the planner/compiler ratio of each. Put the winning mesh in the config
(`--config.mesh.shape.fsdp=...`), or set `--config.mesh.auto=True` to let `--dry_run` use the
best plan for the config's own remat policy and optimiser placement.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402
from launch import cli  # noqa: E402

_CONFIG = cli.define(config_flags.DEFINE_config_file, "config", None, "Config file (configs/*.py[:arg]).",
                                          lock_config=True)
_DEVICES = flags.DEFINE_integer("devices", 0, "Devices to plan for (0: the local count).")
_DEVICE_KIND = flags.DEFINE_string("device_kind", "", "tpu_v5p or h100 ('': the local kind).")
_REMATS = flags.DEFINE_string("remats", "none,dots_no_batch,names,full",
                              "Comma-separated remat policies to try (models/remat.py).")
_OFFLOAD = flags.DEFINE_enum("offload_optimizer", "no", ["no", "yes", "both"],
                             "Optimiser state on the device, in pinned host memory, or both.")
_PROMPT_LEN = cli.define(flags.DEFINE_integer, "prompt_len", None, "Prompt tokens per sequence (default: "
                                   "as launch/dry_run.py).")
_TOP = flags.DEFINE_integer("top", 15, "Rows of the ranking to print.")
_TOPOLOGY = cli.define(flags.DEFINE_string,
    "topology", None, "Defer to the compiler: compile the policy update and the rollout of the "
    "best --verify plans for this TPU topology (e.g. v5p:4x4x4) or GPU host (h100:8; the device "
    "count and kind come from it; needs libtpu or the CUDA plugin, `bash launch/setup.sh "
    "--compilers`) and rank them by whether the compiler's per-device peaks fit the chip.")
_VERIFY = flags.DEFINE_integer("verify", 3, "With --topology: how many of the best plans to "
                               "compile.")


def main(argv):
  del argv
  import jax

  from models import planner
  from models import sharding as sharding_lib
  from rl.config.describe import describe_model
  from rl.core.policy import model_config
  from rl.config.validation import validate
  from rl.parallel import placement
  config = _CONFIG.value
  validate(config)
  cfg = model_config(config)
  topology = None
  if _TOPOLOGY.value:
    from launch import aot, dry_run
    topology = aot.topology_devices(_TOPOLOGY.value)
    device, devices = planner.spec_of(topology[0]), len(topology)
  else:
    device = planner.device_kind(_DEVICE_KIND.value)
    devices = _DEVICES.value or jax.device_count()
  work = placement.workload(config, prompt_len=_PROMPT_LEN.value)
  offload = {"no": (False,), "yes": (True,), "both": (False, True)}[_OFFLOAD.value]
  plans = planner.plan(cfg, work, devices, device, remats=_REMATS.value.split(","),
                       offload_optimizer=offload,
                       rules=sharding_lib.make_rules(config.mesh.rules))
  fitting = sum(p.fits for p in plans)
  print(f"{describe_model(config)}: {devices} x {device.name} "
        f"({device.hbm_bytes / 2**30:.0f} GiB HBM, {planner.USABLE_HBM_FRACTION:.0%} usable); "
        f"{work.sequences} sequences x {work.length} tokens per step in {work.mini_batches} x "
        f"{work.micro_batches} micro-batches, rollouts of {work.rollout_sequences} sequences; "
        f"{len(plans)} plans, {fitting} fit")
  print("memory in GiB per device (peak: the larger of the update and the rollout); "
        "times in s per RL step (roofline)")
  print("\n".join(planner.format_table(plans, _TOP.value)))
  if topology is not None:
    rows = dry_run.verify_plans(config, plans, topology, _VERIFY.value)
    print("\n".join(dry_run.format_verified(rows, device.hbm_bytes)))


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  app.run(main)
