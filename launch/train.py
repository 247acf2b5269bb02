"""Entry point of every training job.

  python launch/train.py --config=configs/demo.py --workdir=/tmp/seedrl_demo
  python launch/train.py --config=configs/demo.py:vapo --config.train.steps=20
  python launch/train.py --config=configs/deepseek_v32_moe_tpu.py --dry_run

The config file's `get_config(arg)` builds the run; `--config.a.b=v` overrides any field (an unknown
field is an error, in the config file too). The config is validated before anything is built: a bad
value, a typo in a field, a missing config file or tokenizer directory, a missing or empty prompt
file, a bad prompt record, a mesh larger than the machine, a workdir that is a file or a broken HF
checkpoint is reported on one line (`error: ...`, exit status 2). Rerunning the same command with
the same workdir resumes from the latest checkpoint; a resume under a changed config is refused on
one line naming the fields that differ (beyond the steps, logging, saving and mesh fields of
rl/jobs/checkpoint.py RESUMABLE_FIELDS) unless --allow_config_change is given, and the change is
then appended to <workdir>/config_history.jsonl (config.json stays the first). The workdir may be
local or remote (`gs://bucket/run`, through etils.epath). SIGTERM or SIGINT saves a checkpoint at
the end of the step in progress and exits with status 0; the same command then resumes.
`--print_config` prints the resolved config and exits; `--help` lists the config's fields with their
meanings. `--dry_run` builds the mesh, model and optimiser abstractly, prints parameter counts and
per-device memory (launch/dry_run.py) and exits. On several hosts every process runs this same
command; they join one JAX runtime from the launcher's environment (rl/parallel/distributed.py)
before any device is touched.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import platforms  # noqa: E402

platforms.settle()  # before jax is imported

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import cli, logs  # noqa: E402
from rl.core import storage  # noqa: E402
from rl.core.checks import InputError  # noqa: E402
from rl.config.validation import check_paths  # noqa: E402

_CONFIG = cli.define(config_flags.DEFINE_config_file, "config", None, "Config file (configs/*.py[:arg]).",
                                          lock_config=True)
_WORKDIR = cli.define(flags.DEFINE_string,
    "workdir", None, "Output directory (checkpoints, metrics). Default: "
    "./workdir/<config file name>[_<variant>] (configs/demo.py:vapo -> workdir/demo_vapo).")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print parameter counts and per-device memory of "
                             "the config's mesh, model and optimiser (built abstractly), then "
                             "exit without training.")
_ALLOW_CONFIG_CHANGE = flags.DEFINE_bool(
    "allow_config_change", False, "Resume a workdir under a config that differs from the one it "
    "ran with (beyond rl/jobs/checkpoint.py RESUMABLE_FIELDS: steps, logging, saving, mesh); "
    "the change is appended to <workdir>/config_history.jsonl.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config (the file's, with the --config overrides, "
    "validated) as <field>=<value> lines and the run's workdir, then exit.")
_TOPOLOGY = cli.define(flags.DEFINE_string,
    "topology", None, "With --dry_run: compile the policy update and the rollout ahead of time "
    "for this TPU topology (e.g. v5p:2x2x1, v5e:4x4, v6e:2x2; needs libtpu) or GPU host (h100:8; "
    "needs the CUDA plugin and a CUDA toolkit's ptxas), `bash launch/setup.sh --compilers`, and "
    "report the compiler's memory analysis beside the analytic estimate.")


cli.define_help_flags()


def main(argv):
  cli.no_arguments(argv)
  config = cli.checked_config(_CONFIG.value)
  workdir = _WORKDIR.value or os.path.join("workdir", cli.config_name())
  if _PRINT_CONFIG.value:
    print(f"# workdir: {workdir}\n{cli.format_config(config)}")
    return
  if _TOPOLOGY.value and not _DRY_RUN.value:
    raise app.UsageError("--topology compiles ahead of time: use it with --dry_run")
  if _DRY_RUN.value:
    from launch import aot, dry_run
    if _TOPOLOGY.value:
      r = dry_run.report(config, compile_step=True,
                         devices=aot.topology_devices(_TOPOLOGY.value))
    else:
      r = dry_run.report(config)
    print("\n".join(dry_run.format_report(r)))
    return
  check_paths(config)
  cli.check_workdir(workdir)
  from rl.jobs import checkpoint
  from rl.parallel import distributed, placement
  distributed.initialize_from_env()
  placement.check_devices(config.mesh)
  # Remote paths (gs://...) stay as they are; a relative local one is made absolute.
  workdir = checkpoint.workdir_path(workdir)
  storage.preflight(workdir, "--workdir")  # credentials and an answer, in seconds
  logging.info("workdir: %s", workdir)
  from launch import jobs
  try:
    jobs.run_job(config, str(workdir), allow_config_change=_ALLOW_CONFIG_CHANGE.value)
  except checkpoint.Preempted as e:
    logging.info("%s", e)


if __name__ == "__main__":
  from models.hf import CheckpointError
  logs.run(main, bad_input=(InputError, CheckpointError, FileNotFoundError))
