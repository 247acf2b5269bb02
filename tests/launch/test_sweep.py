"""The experiment runner (launch/sweep.py): the grid is parsed and every grid point's config
checked before any run starts, with one line naming what is wrong; run names are deterministic
and distinct; runs go to their own workdirs, a rerun skips the finished ones and restarts the
others, a failed run does not stop the rest; the table, JSON and plots come from metrics.jsonl.
The fast tests stand a small fake trainer in for launch/train.py; the slow one runs the real
one (tiny model) and kills a run halfway."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from launch import sweep
from rl.core.checks import InputError

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEMO = os.path.join(ROOT, "configs", "demo.py")
# A 1-layer dense model, 2 prompts x 2 samples, 3 RL steps with a held-out evaluation and a
# checkpoint after each: seconds of training, the rest compiling (~30 s a run on 2 CPU cores).
TINY = ["--config.job=rl", "--config.model.n_layers=1", "--config.model.dsa=False",
        "--config.rl.indexer_coef=0", "--config.model.attention=gqa", "--config.model.n_experts=0",
        "--config.model.first_k_dense=0", "--config.data.train_size=16",
        "--config.data.heldout_size=8", "--config.rollout.max_new_tokens=8",
        "--config.train.steps=3", "--config.train.prompts_per_step=2",
        "--config.train.samples_per_prompt=2", "--config.train.eval_every=1",
        "--config.train.checkpoint_every=1", "--config.rl.dynamic_sampling=False",
        "--config.mesh.devices=1"]
GRID = "rl.clip_high=0.2,0.28;rl.loss_agg_mode=token-mean,seq-mean-token-sum"


def test_grid_parses_into_axes_and_their_product():
  axes = sweep.parse_grid(" rl.clip_high=0.2,0.28 ; rl.loss_agg_mode=token-mean,seq-mean-token-sum")
  assert axes == [("rl.clip_high", ["0.2", "0.28"]),
                  ("rl.loss_agg_mode", ["token-mean", "seq-mean-token-sum"])]
  points = sweep.grid_points(axes)
  assert len(points) == 4
  assert points[1] == (("rl.clip_high", "0.2"), ("rl.loss_agg_mode", "seq-mean-token-sum"))
  assert sweep.parse_grid("") == [] and sweep.grid_points([]) == [()]
  assert sweep.parse_seeds("0,1,2") == [0, 1, 2]


@pytest.mark.parametrize("grid, message", [
    ("rl.clip_high", "--grid axis 'rl.clip_high': expected <config field>=<value>"),
    ("rl.clip_high=0.2;", "--grid axis '': expected"),
    ("rl clip=0.2", "--grid axis 'rl clip=0.2'"),
    ("rl.clip_high=0.2,,0.3", "--grid axis 'rl.clip_high=0.2,,0.3': an empty or repeated value"),
    ("rl.clip_high=0.2,0.2", "an empty or repeated value"),
    ("rl.clip_high=0.2;rl.clip_high=0.3", "--grid field rl.clip_high is given twice"),
    ("seed=1,2", "give the seeds with --seeds"),
])
def test_bad_grid_syntax_is_one_line_naming_the_axis(grid, message):
  with pytest.raises(InputError) as e:
    sweep.parse_grid(grid)
  assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("grid, message", [
    ("rl.clip_hig=0.2,0.28", "--grid field rl.clip_hig: not a config field (did you mean "
                             "rl.clip_high?)"),
    ("zzz.qqq=1", "--grid field zzz.qqq: not a config field (--help lists them)"),
    ("rl.clip_high=0.2,wide", "--grid point rl.clip_high=wide:"),
    ("rl.loss_agg_mode=token-mean,token-sum-of-nothing",
     "--grid point rl.loss_agg_mode=token-sum-of-nothing: config.rl.loss_agg_mode"),
])
def test_unknown_field_or_bad_value_is_named_before_any_run(tmp_path, grid, message):
  with pytest.raises(InputError) as e:
    sweep.plan(DEMO, TINY, grid, [0], str(tmp_path))
  assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_command_line_refuses_a_bad_grid_on_one_line_and_starts_nothing(tmp_path):
  root = tmp_path / "sweep"
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "sweep.py"),
                        f"--config={DEMO}", *TINY, "--grid=rl.clip_high=0.2;zzz.qqq=1",
                        f"--root={root}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert out.returncode == 2, out.stderr[-2000:]
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  assert errors == ["error: --grid field zzz.qqq: not a config field (--help lists them)"], \
      out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert not root.exists()


def test_run_names_are_deterministic_distinct_and_safe_directory_names(tmp_path):
  runs = sweep.plan(DEMO, TINY, GRID, [0, 1], str(tmp_path))
  again = sweep.plan(DEMO, TINY, GRID, [0, 1], str(tmp_path))
  names = [r.name for r in runs]
  assert names == [r.name for r in again]
  assert len(set(names)) == len(names) == 8
  assert names[0] == "rl.clip_high=0.2,rl.loss_agg_mode=token-mean,seed=0"
  assert {r.workdir for r in runs} == {os.path.join(str(tmp_path), n) for n in names}
  assert [r.name for r in sweep.plan(DEMO, TINY, "", [3], str(tmp_path))] == ["seed=3"]
  # Characters a path should not hold are replaced, and a hash keeps such names apart.
  slash = sweep.run_name((("data.train_files", "a/b"),), 0)
  underscore = sweep.run_name((("data.train_files", "a_b"),), 0)
  assert "/" not in slash and slash != underscore
  assert slash == sweep.run_name((("data.train_files", "a/b"),), 0)
  long = sweep.run_name((("data.train_files", "x" * 300),), 0)
  assert len(long) < 200 and long != sweep.run_name((("data.train_files", "x" * 301),), 0)


FAKE_TRAINER = """
import json, os, sys
workdir, steps, seed, die_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
ckpts = os.path.join(workdir, "checkpoints")
os.makedirs(ckpts, exist_ok=True)
start = max([int(d) for d in os.listdir(ckpts)] or [0])
print("resumed at", start)
with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
  for step in range(start + 1, steps + 1):
    if step == die_at:
      sys.exit(3)
    f.write(json.dumps({"step": step, "heldout_acc": (seed + step) / 10, "entropy": 1.0 / step,
                        "wall_s": 2.0 * step}) + "\\n")
    os.makedirs(os.path.join(ckpts, str(step)))
"""


def fake_command(script, die_at=None):
  """launch/train.py's stand-in: writes metrics rows and a checkpoint directory per step from
  its last checkpoint on; exits with status 3 at the step `die_at(run)` (0: never)."""
  return lambda run: [sys.executable, str(script), run.workdir, str(run.steps), str(run.seed),
                      str(die_at(run) if die_at else 0)]


def starts(run) -> int:
  """How many times the sweep started the run (the header it writes before each start)."""
  if not os.path.exists(run.log):
    return 0
  with open(run.log) as f:
    return sum(line.startswith("# sweep: started") for line in f)


def test_sweep_runs_resumes_skips_and_reports(tmp_path):
  """2 grid points x 2 seeds: one run dies halfway and one fails outright (reported, the others
  go on); the rerun starts only those two, the dead one from its checkpoint; the table has one
  row per grid point with mean and min-max over seeds; the plots are written."""
  script = tmp_path / "fake_train.py"
  script.write_text(FAKE_TRAINER)
  root = str(tmp_path / "sweep")
  runs = sweep.plan(DEMO, TINY, "rl.clip_high=0.2,0.28", [0, 1], root)
  dying = runs[1]  # clip 0.2, seed 1: dies before step 2
  failing = runs[3]  # clip 0.28, seed 1: dies at step 1
  first = sweep.execute(runs, fake_command(script, lambda r: {dying: 2, failing: 1}.get(r, 0)),
                        parallel=2)
  assert first == [dying, failing]
  assert [sweep.is_finished(r) for r in runs] == [True, False, True, False]
  assert [starts(r) for r in runs] == [1, 1, 1, 1]
  again = sweep.execute(runs, fake_command(script), parallel=1)
  assert again == []
  assert [starts(r) for r in runs] == [1, 2, 1, 2]  # the finished runs were not started
  assert "resumed at 1" in open(dying.log).read()
  with open(os.path.join(dying.workdir, "metrics.jsonl")) as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 3]
  points = sweep.report(runs, root, "python launch/sweep.py ...")
  table = open(os.path.join(root, "sweep.md")).read()
  rows = [line for line in table.splitlines() if line.startswith("| rl.clip_high=")]
  # Final held-out accuracy of the fake: (seed + 3) / 10, so 0.3 and 0.4 over seeds 0 and 1.
  # Its mean over the evaluations: (0.1 + 0.2 + 0.3) / 3 and (0.2 + 0.3 + 0.4) / 3, 0.25 over
  # the seeds. Its entropy is 1/step: (1 + 1/2 + 1/3) / 3 = 0.6111 averaged over the steps (all
  # three are the last 5).
  assert rows == ["| rl.clip_high=0.2 | 2/2 | 0.350 | 0.300-0.400 | 3 | 0.250 | 6 | 0.6111 | "
                  "0.6111 |",
                  "| rl.clip_high=0.28 | 2/2 | 0.350 | 0.300-0.400 | 3 | 0.250 | 6 | 0.6111 | "
                  "0.6111 |"]
  saved = json.load(open(os.path.join(root, "sweep.json")))
  assert saved["points"] == json.loads(json.dumps(points))
  curve = saved["points"][0]["acc_vs_step"]
  assert curve["x"] == [1, 2, 3] and curve["mean"] == pytest.approx([0.15, 0.25, 0.35])
  assert curve["min"] == pytest.approx([0.1, 0.2, 0.3])
  assert curve["max"] == pytest.approx([0.2, 0.3, 0.4])
  assert saved["points"][0]["acc_vs_time"]["x"] == [2.0, 4.0, 6.0]
  for png in sweep.PLOTS:
    assert open(os.path.join(root, png), "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_steps_to_a_target_count_only_the_seeds_that_reach_it(tmp_path):
  """--target: the first evaluation at or above it, per seed (step and wall time); the table's
  mean and min-max are over the seeds that reached it, and says how many did."""
  script = tmp_path / "fake_train.py"
  script.write_text(FAKE_TRAINER)
  runs = sweep.plan(DEMO, TINY, "", [0, 1, 2], str(tmp_path))
  sweep.execute(runs, fake_command(script), parallel=1)
  # The fake's held-out accuracy is (seed + step) / 10 at steps 1-3: seed 0 never reaches 0.35,
  # seed 1 reaches it at step 3 (wall 6 s), seed 2 at step 2 (wall 4 s).
  (point,) = sweep.report(runs, str(tmp_path), "cmd", target=0.35)
  assert point["to_target"]["per_seed"] == {0: None, 1: (3, 6.0), 2: (2, 4.0)}
  assert point["to_target"]["steps"] == {"mean": 2.5, "min": 2, "max": 3}
  row = [line for line in open(tmp_path / "sweep.md") if line.startswith("| base |")]
  assert row == ["| base | 3/3 | 0.400 | 0.300-0.500 | 3 | 0.300 | 6 | 0.6111 | 0.6111 | "
                 "2.5 [2-3] (2/3) | 5 [4-6] |\n"]
  (never,) = sweep.report(runs, str(tmp_path), "cmd", target=0.9)
  assert never["to_target"]["reached"] == 0
  assert "| not reached (0/3) | - |" in open(tmp_path / "sweep.md").read()


def test_report_counts_only_finished_seeds(tmp_path):
  script = tmp_path / "fake_train.py"
  script.write_text(FAKE_TRAINER)
  runs = sweep.plan(DEMO, TINY, "", [0, 1], str(tmp_path))
  sweep.execute(runs, fake_command(script, lambda r: 2 if r.seed == 1 else 0), parallel=1)
  (point,) = sweep.report(runs, str(tmp_path), "cmd")
  assert point["seeds"] == [0] and point["final_heldout_acc"]["mean"] == 0.3
  assert "| base | 1/2 | 0.300 |" in open(tmp_path / "sweep.md").read()


def test_a_failed_run_is_one_line_naming_its_log_and_the_sweep_exits_1(tmp_path):
  """Both runs fail in launch/train.py (a prompt file that is not there, which train.py checks
  at start): each is reported on one line with its log, the table is still written, and the
  sweep's exit status is 1."""
  root = tmp_path / "sweep"
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "sweep.py"),
                        f"--config={DEMO}", *TINY, "--config.sft.carry_slip_rate=0",
                        "--config.data.source=files", "--config.data.train_files=/nowhere.jsonl",
                        "--seeds=0,1", f"--root={root}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  failed = [line for line in out.stderr.splitlines() if "FAILED" in line]
  assert len(failed) == 2, out.stderr[-3000:]
  for seed, line in zip((0, 1), failed):
    assert f"FAILED seed={seed} (exit status 2; last line: error: config.data.train_files=" in line
    assert line.endswith(f"see {root}/seed={seed}/train.log")
  assert "| base | 0/2 | - |" in (root / "sweep.md").read_text()


def _sweep(root, *args, **kwargs):
  return subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "sweep.py"),
                           f"--config={DEMO}", *TINY, f"--root={root}", *args],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True, **kwargs)


@pytest.mark.slow
def test_real_sweep_end_to_end_with_a_run_killed_halfway(tmp_path):
  """launch/sweep.py over launch/train.py, 2 grid points x 2 seeds of a tiny model: killed (the
  sweep and its trainer) once a run has saved step 1, the rerun resumes that run from its
  checkpoint and runs the other three, and the table has 2 rows; a third run starts nothing
  (no run's train.log is touched); --report_only rebuilds the table
  without starting a run. 122 s on the 2-core CPU host (2026-11-27)."""
  root = tmp_path / "sweep"
  args = ["--grid=rl.clip_high=0.2,0.28", "--seeds=0,1"]
  proc = _sweep(root, *args)
  first = root / "rl.clip_high=0.2,seed=0"
  deadline = time.time() + 300
  while not (first / "checkpoints" / "1").is_dir():
    assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
    time.sleep(0.2)
  os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  assert not (first / "checkpoints" / "3").exists()
  out, _ = _sweep(root, *args).communicate(timeout=600)
  assert "4 runs: 0 finished before, 4 to run" in out and "4 of 4 runs finished" in out, out[-3000:]
  assert "resumed from" in (first / "train.log").read_text()
  rows = [json.loads(line) for line in open(first / "metrics.jsonl")]
  assert [r["step"] for r in rows] == [1, 2, 3]
  # The trainer's wall time, earlier legs included, on every row: the time axis of the plot.
  assert 0 < rows[0]["wall_s"] < rows[1]["wall_s"] < rows[2]["wall_s"]
  table = (root / "sweep.md").read_text()
  assert len([line for line in table.splitlines() if line.startswith("| rl.clip_high=")]) == 2
  logs = {p: p.stat().st_mtime for p in root.glob("*/train.log")}
  out, _ = _sweep(root, *args).communicate(timeout=300)
  assert "4 runs: 4 finished before, 0 to run" in out, out[-3000:]
  assert {p: p.stat().st_mtime for p in root.glob("*/train.log")} == logs
  (root / "sweep.md").unlink()
  out, _ = _sweep(root, *args, "--report_only").communicate(timeout=300)
  assert "] start " not in out and (root / "sweep.md").read_text() == table
  assert (root / "entropy_vs_step.png").exists()


def test_points_put_other_sweeps_runs_side_by_side(tmp_path):
  """--points: runs of two sweeps (one a grid point's, one a base config's) reported as one table
  with a row per label, each over its own seeds; an entry that names no run is one line."""
  script = tmp_path / "fake_train.py"
  script.write_text(FAKE_TRAINER)
  for sub, grid in (("a", "train.steps=3"), ("b", "")):
    runs = sweep.plan(DEMO, TINY, grid, [0, 1] if sub == "a" else [2], str(tmp_path / sub))
    sweep.execute(runs, fake_command(script), parallel=1)
    for run in runs:  # what train.py writes beside the metrics
      with open(os.path.join(run.workdir, "config.json"), "w") as f:
        json.dump({"job": run.job, "train": {"steps": run.steps}}, f)
  runs = sweep.runs_of_points(f"A={tmp_path}/a/train.steps=3,;B={tmp_path}/b/")
  assert [(r.point, r.seed) for r in runs] == [("A", 0), ("A", 1), ("B", 2)]
  points = sweep.report(runs, str(tmp_path / "out"), "cmd")
  # The fake's held-out accuracy at its last step is (seed + steps) / 10.
  assert [(p["point"], p["seeds"], round(p["final_heldout_acc"]["mean"], 6)) for p in points] == [
      ("A", [0, 1], 0.35), ("B", [2], round((2 + runs[-1].steps) / 10, 6))]
  with pytest.raises(InputError, match="--points C: no run .*/c/seed=N"):
    sweep.runs_of_points(f"C={tmp_path}/c/")
  with pytest.raises(InputError, match="write it label=<workdir prefix>"):
    sweep.runs_of_points("nolabel")
