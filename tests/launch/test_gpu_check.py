"""The GPU check (launch/gpu_check.sh, docs/gpu.md) in smoke mode: every step of the command
runs at tiny sizes on CPU, so the command cannot rot between GPU runs, and a step that fails
makes the command fail."""

import json
import os
import subprocess
import sys

import pytest

from launch import gpu_check, gpu_steps

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_smoke_runs_every_step(tmp_path):
  """`bash launch/gpu_check.sh OUT --smoke` exits 0 with each of the six steps ok, each with
  measured rows, and writes the markdown table of every step."""
  proc = subprocess.run(["bash", "launch/gpu_check.sh", str(tmp_path), "--smoke"],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  results = json.loads((tmp_path / "results.json").read_text())
  assert list(results["steps"]) == list(gpu_check.STEP_NAMES)
  for name, step in results["steps"].items():
    assert step["status"] == "ok" and step["rows"], (name, step)
  table = (tmp_path / "results.md").read_text()
  assert all(f"## {name}: ok" in table for name in gpu_check.STEP_NAMES), table
  assert results["meta"]["exit"] == 0 and results["meta"]["smoke"]


def test_a_step_out_of_time_fails_the_command(tmp_path):
  """A step stopped at its time limit is recorded as failed and the command exits 1."""
  proc = subprocess.run([sys.executable, "-m", "launch.gpu_check", f"--out={tmp_path}",
                         "--smoke", "--steps=env", "--budgets=env:0.5"],
                        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1, proc.stdout[-2000:]
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["steps"]["env"]["status"].startswith("failed (out of time")
  assert results["meta"]["failed"] == ["env"]


@pytest.mark.parametrize("argument, culprit", [("--steps=env,dsaa", "dsaa"),
                                               ("--budgets=demo:ten", "demo:ten"),
                                               ("--budgets=train2:5", "train2")])
def test_bad_arguments_are_named_at_start(tmp_path, argument, culprit):
  proc = subprocess.run([sys.executable, "-m", "launch.gpu_check", f"--out={tmp_path}",
                         argument], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
  assert proc.returncode != 0 and culprit in proc.stderr
  assert not (tmp_path / "results.json").exists()


@pytest.mark.parametrize("kind, peaks", [("NVIDIA H100 80GB HBM3", (989.4, 3.35)),
                                         ("NVIDIA H100 PCIe", (756.0, 2.0)),
                                         ("NVIDIA H100 NVL", (835.0, 3.9)),
                                         ("NVIDIA H200", (989.4, 4.8)),
                                         ("cpu", (None, None))])
def test_spec_sheet_peaks_by_device_kind(kind, peaks):
  """The more specific part names win over the bare "H100" (PCIe and NVL are slower)."""
  assert gpu_steps.spec_peaks(kind) == peaks
