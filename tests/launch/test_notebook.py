"""The Colab notebook (launch/colab_small_models.ipynb) runs top to bottom in the default suite:
every code cell in order, in one namespace, in a fresh interpreter started in the notebook's
folder (tests/launch/notebook_runner.py, a kernel without Jupyter), in its QUICK form (two SFT
and two RL steps: SEEDRL_NOTEBOOK_QUICK=1) and with the project installed already
(SEEDRL_INSTALLED=1: the install cell only finds the checkout). One device, as on Colab. The
runner's own handling of what a kernel adds is checked on a constructed notebook."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NOTEBOOK = os.path.join(ROOT, "launch", "colab_small_models.ipynb")
RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "notebook_runner.py")


def run_notebook(path, tmp_path, **env_overrides):
  """(completed process, report) of the runner on `path`, started in its folder."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(JAX_PLATFORMS="cpu", MPLBACKEND="Agg", **env_overrides)
  report = tmp_path / "report.json"
  proc = subprocess.run([sys.executable, RUNNER, str(path), str(report)],
                        cwd=os.path.dirname(os.path.abspath(path)), env=env,
                        capture_output=True, text=True, timeout=900)
  return proc, json.loads(report.read_text())


def test_colab_notebook_runs_top_to_bottom_and_shows_the_curve(tmp_path):
  """Every code cell runs without raising; the last one displays the learning curve as a PNG;
  the job wrote results.json with both held-out accuracies, 2 RL metrics rows (the QUICK
  parameter took effect) and SFT's own metrics.jsonl; its progress lines name the stage and
  give an ETA."""
  workdir = tmp_path / "demo"
  proc, report = run_notebook(NOTEBOOK, tmp_path, SEEDRL_INSTALLED="1",
                              SEEDRL_NOTEBOOK_QUICK="1", SEEDRL_WORKDIR=str(workdir))
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert report["cells_run"] == report["cells"] >= 5
  pngs = [d for d in report["displayed"] if d["mime"] == "image/png"]
  assert len(pngs) == 1 and pngs[0]["is_png"] and pngs[0]["bytes"] > 1000, report
  results = json.loads((workdir / "results.json").read_text())
  assert 0 <= results["sft_heldout_acc"] <= 1 and 0 <= results["rl_heldout_acc"] <= 1
  rl_rows = [json.loads(line) for line in (workdir / "rl" / "metrics.jsonl").open()]
  assert [r["step"] for r in rl_rows] == [1, 2] and all("heldout_acc" in r for r in rl_rows)
  assert (workdir / "sft" / "metrics.jsonl").exists()
  assert re.search(r"\[stage 1/2\] sft step 2/2 .* 100% .* ETA 0s", proc.stderr), proc.stderr
  assert re.search(r"\[stage 2/2\] step 1/2 .* 50% .* ETA \d", proc.stderr), proc.stderr


def test_runner_shares_one_namespace_runs_shell_lines_and_stops_at_a_raising_cell(tmp_path):
  """Cells share names; `!` runs the shell (a failing command raises); a last expression is
  displayed; a raising cell ends the run with exit status 1 naming it, and later cells do not
  run; a magic raises naming the line."""
  def notebook(*sources):
    path = tmp_path / "nb.ipynb"
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "source": s, "metadata": {}, "outputs": []} for s in sources]}))
    return path

  proc, report = run_notebook(notebook("x = 41\nif x:\n  !echo hi > shell.txt", "x + 1",
                                       "raise ValueError('boom')", "open('late', 'w')"),
                              tmp_path)
  assert proc.returncode == 1
  assert "notebook code cell 2 raised" in proc.stderr and "ValueError: boom" in proc.stderr
  assert report == {"cells": 4, "cells_run": 2,
                    "displayed": [{"mime": "text/plain", "text": "42"}]}
  assert (tmp_path / "shell.txt").read_text() == "hi\n" and not (tmp_path / "late").exists()
  proc, report = run_notebook(notebook("!exit 3"), tmp_path)
  assert proc.returncode == 1 and report["cells_run"] == 0
  proc, report = run_notebook(notebook("%matplotlib inline"), tmp_path)
  assert proc.returncode == 1 and "magic '%matplotlib' is not supported" in proc.stderr
