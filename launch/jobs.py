"""The job a run config names (config.job) and the function that runs it: what launch/train.py
calls once the run's processes and workdir are set up. It sits in the launch layer because the
O1-Coder job builds on the SFT and preference jobs (rl/o1_coder imports rl/jobs), so only a layer
above both may choose between them."""

import ml_collections

from rl.config.validation import PREFERENCE_HEADS


def run_job(config: ml_collections.ConfigDict, workdir: str, *,
            allow_config_change: bool = False) -> None:
  """Runs config.job: "rl" (rl/jobs/trainer.py), "sft" (rl/jobs/sft.py), "o1_coder"
  (rl/o1_coder/selfplay.py), "sft_rl" (rl/jobs/sft_then_rl.py) or a preference job, "bt_rm",
  "genrm" or "dpo" (rl/jobs/preference_jobs.py). `allow_config_change`: a run
  resuming its workdir may do so under another config (rl/jobs/checkpoint.py save_run_config);
  O1-Coder self-play keeps no checkpoints, so it never resumes."""
  if config.job == "rl":
    from rl.jobs import trainer
    trainer.run(config, workdir, allow_config_change=allow_config_change)
  elif config.job == "sft":
    from rl.jobs import sft
    sft.run(config, workdir, allow_config_change=allow_config_change)
  elif config.job in PREFERENCE_HEADS:
    from rl.jobs import preference_jobs
    preference_jobs.run(config, workdir, allow_config_change=allow_config_change)
  elif config.job == "o1_coder":
    from rl.o1_coder import selfplay
    selfplay.run(config, workdir)
  else:
    from rl.jobs import sft_then_rl
    sft_then_rl.run_sft_then_rl(config, workdir, allow_config_change=allow_config_change)
