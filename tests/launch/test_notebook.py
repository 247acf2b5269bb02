"""The Colab notebook (launch/colab_small_models.ipynb) runs top to bottom in the default suite:
every code cell in order, in one namespace, in a fresh interpreter started in the notebook's
folder (tests/launch/notebook_runner.py, a kernel without Jupyter), in its QUICK form (two SFT
and two RL steps: SEEDRL_NOTEBOOK_QUICK=1) and with the project installed already
(SEEDRL_INSTALLED=1: the install cell only finds the checkout). One device, as on Colab. The
runner's own handling of what a kernel adds is checked on a constructed notebook. The install
cell, which the QUICK run skips, is run on its own with the shell commands recorded."""

import json
import os
import re
import subprocess
import sys

import pytest

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


def run_install_cell(tmp_path, monkeypatch, repo_url=None):
  """The shell commands (argument lists) of the notebook's first code cell, run in an empty
  folder (no checkout around it, as on Colab) with SEEDRL_INSTALLED unset; `repo_url` replaces
  the REPO_URL the notebook ships with. A `git clone` makes its target folder and nothing runs."""
  with open(NOTEBOOK) as f:
    cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
  source = "".join(cells[0]["source"])
  if repo_url is not None:
    source = re.sub(r"^REPO_URL = .*$", f"REPO_URL = {repo_url!r}", source, flags=re.M)
  commands = []

  def record(args, **kwargs):
    commands.append(list(args))
    if args[:2] == ["git", "clone"]:
      os.makedirs(args[-1])
    return subprocess.CompletedProcess(args, 0)

  colab = tmp_path / "colab"
  colab.mkdir(parents=True)
  monkeypatch.chdir(colab)
  monkeypatch.delenv("SEEDRL_INSTALLED", raising=False)
  monkeypatch.setattr(subprocess, "run", record)
  monkeypatch.setattr(sys, "path", list(sys.path))
  exec(compile(source, "install cell", "exec"), {})
  return commands


def test_install_cell_clones_only_a_given_url_and_pins_every_install(tmp_path, monkeypatch):
  """Without a checkout, the install cell as shipped stops on one line asking for REPO_URL and
  runs nothing (no clone of a guessed URL); given a REPO_URL it clones exactly that, then
  installs the requirements at the versions requirements.lock pins (as launch/setup.sh does)
  and the project without its dependencies: no install is left unpinned."""
  with pytest.raises(RuntimeError, match=r"set REPO_URL") as stopped:
    run_install_cell(tmp_path / "as_shipped", monkeypatch)
  assert "\n" not in str(stopped.value)
  url = "https://example.com/fork/seedrl.git"
  commands = run_install_cell(tmp_path / "given", monkeypatch, repo_url=url)
  assert commands[0] == ["git", "clone", "--depth=1", url, "seedrl"], commands
  pips = [c[c.index("pip") + 1:] for c in commands if "pip" in c]
  assert pips and len(pips) == len(commands) - 1, commands
  for args in pips:
    assert args[0] == "install", args
    pinned = "-c" in args and args[args.index("-c") + 1] == "requirements.lock"
    assert pinned or "--no-deps" in args, args
  assert any("-r" in args and args[args.index("-r") + 1] == "requirements.txt" for args in pips)
  assert os.path.exists(os.path.join(ROOT, "requirements.lock"))
