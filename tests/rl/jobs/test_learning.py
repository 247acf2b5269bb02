"""Learning gates: the demo's promise (RL visibly beats its SFT start) checked by running it.

The fast gates are the demo command, as a user runs it (launch/train.py in its own process, one
CPU device), shortened to 25 RL steps, one per recipe on the model card: DAPO,
VAPO (its 10 value-pretraining steps included) and DeepSeek-V3.2's GRPO, each with the same
verifier and from one SFT stage, which the first gate trains and the others find finished (the
demo's cold start: most of the gates' time). They fail when learning breaks (a flipped
policy-gradient sign, a zero learning rate, a verifier that rewards nothing); their margins
were measured (README, "The demo"). The slow tests run the README's commands themselves and
hold them to the bar: >= 0.80 held-out, >= 15 points over SFT.
"""

import json
import os
import subprocess
import sys

import pytest

from tests.launch.test_launch import launcher_env

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))

# Fast gates: the demo with these many RL steps per recipe. Measured gains are in the README;
# the margin sits well below the smallest of them and far above a broken run's.
GATE_RL_STEPS = {"dapo": 25, "vapo": 25, "grpo_v32": 25}
GATE_MIN_GAIN = 0.10


def train(workdir, algorithm: str, *flags: str) -> dict:
  """`python launch/train.py --config=configs/demo.py:<algorithm> <flags> --workdir=<workdir>`
  in the launcher's environment; its results.json."""
  subprocess.run([sys.executable, os.path.join(REPO_ROOT, "launch", "train.py"),
                  "--config=" + os.path.join(REPO_ROOT, "configs", "demo.py") + ":" + algorithm,
                  *flags, f"--workdir={workdir}"],
                 check=True, timeout=3600, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                 env=launcher_env())
  return json.loads((workdir / "results.json").read_text())


@pytest.fixture(scope="module")
def gate_workdir(tmp_path_factory):
  """One workdir whose `sft` stage every gate starts from: trained by the first gate to run,
  found finished (and its held-out accuracy read back) by the others."""
  return tmp_path_factory.mktemp("gate")


def run_gate(algorithm: str, workdir) -> dict:
  """The demo command of `algorithm`, shortened to GATE_RL_STEPS, in <workdir>/<algorithm>, its
  `sft` stage the shared one."""
  own = workdir / algorithm
  own.mkdir()
  (workdir / "sft").mkdir(exist_ok=True)
  os.symlink(workdir / "sft", own / "sft")
  steps = GATE_RL_STEPS[algorithm]
  # The shared SFT stage was run under the first gate's config: the others differ in their
  # RL sections, which a resume refuses unless allowed (rl/jobs/checkpoint.save_run_config).
  return train(own, algorithm, f"--config.train.steps={steps}", "--config.train.eval_every=0",
               f"--config.train.checkpoint_every={steps}", "--allow_config_change")


@pytest.mark.parametrize("algorithm", list(GATE_RL_STEPS))
def test_rl_beats_its_sft_start(algorithm, gate_workdir):
  """The shortened demo: RL from the SFT checkpoint raises greedy held-out accuracy by at
  least GATE_MIN_GAIN (a sign-flipped or zero-rate update cannot: see the README)."""
  results = run_gate(algorithm, gate_workdir)
  assert results["rl_heldout_acc"] >= results["sft_heldout_acc"] + GATE_MIN_GAIN, results


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(GATE_RL_STEPS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_demo_command_meets_its_bar(algorithm, seed, tmp_path):
  """`python launch/train.py --config=configs/demo.py:<algorithm> --config.seed=N`: the RL
  checkpoint reaches >= 0.80 held-out greedy accuracy and >= 15 points over its own SFT
  checkpoint."""
  results = train(tmp_path, algorithm, f"--config.seed={seed}")
  assert results["rl_heldout_acc"] >= 0.80, results
  assert results["rl_heldout_acc"] >= results["sft_heldout_acc"] + 0.15, results
