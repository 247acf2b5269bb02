"""The job a run config names (config.job) and the function that runs it: what launch/train.py
calls once the run's processes and workdir are set up. It sits in the launch layer because the
O1-Coder job builds on the SFT and preference jobs (rl/o1_coder imports rl/jobs), so only a layer
above both may choose between them."""

import ml_collections


def run_job(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Runs config.job: "rl" (rl/jobs/trainer.py), "sft" (rl/jobs/sft.py), "o1_coder"
  (rl/o1_coder/selfplay.py) or "sft_rl" (rl/jobs/sft_then_rl.py)."""
  if config.job == "rl":
    from rl.jobs import trainer
    trainer.run(config, workdir)
  elif config.job == "sft":
    from rl.jobs import sft
    sft.run(config, workdir)
  elif config.job == "o1_coder":
    from rl.o1_coder import selfplay
    selfplay.run(config, workdir)
  else:
    from rl.jobs import sft_then_rl
    sft_then_rl.run_sft_then_rl(config, workdir)
