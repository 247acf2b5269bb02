"""Experiment runner: a grid of config overrides x seeds, each run a launch/train.py process with
a workdir of its own; a rerun resumes the sweep; then one table and plots over the seeds.

  python launch/sweep.py --config=configs/demo.py --root=workdir/sweep_clip --seeds=0,1,2 \\
      --grid='rl.clip_high=0.2,0.28;rl.loss_agg_mode=token-mean,seq-mean-token-sum'

--grid: axes separated by ";", each `<config field>=<value>,<value>,...`; the grid points are the
product of the axes (here 2 x 2), each run for every seed of --seeds. A value is written as on
train.py's command line and cannot hold "," or ";". `--config.a.b=v` flags (the `=` form) go to
every run. Before any run starts, each grid point's config is built and validated as train.py
builds it (launch/gke/render.py job_config): a malformed axis, an unknown field or a bad value
is one line `error: ...` naming it.

A run is `python launch/train.py --config=<config> <--config.a.b=v...> <grid point> --config.seed=S
--workdir=<root>/<name>`, its output appended to <root>/<name>/train.log, where <name> is the
grid point and the seed (`rl.clip_high=0.2,rl.loss_agg_mode=token-mean,seed=0`; `seed=0`
without --grid). --parallel runs go at once. A run is finished when its trainer has saved the
last step: <workdir>/results.json for job "sft_rl" (written after both stages), the checkpoint
<workdir>/checkpoints/<config.train.steps> for job "rl". Rerunning the same command skips the
finished runs and starts the others again, which resume from their workdirs' checkpoints. A
failed run is reported on one line naming its log and the others go on; the sweep then exits
with status 1.

Then, and alone with --report_only, from the finished runs' metrics.jsonl (the RL stage's):
<root>/sweep.md, a table with one row per grid point (the final held-out accuracy's mean and
min-max over seeds, the seeds counted, the mean over each run's evaluations (the area under
its curve), the policy's entropy averaged over the steps and over the last 5; with
--target=A also the steps and RL wall time to a held-out accuracy of A, over the seeds that
reached it), <root>/sweep.json with the same and the per-seed values,
and accuracy_vs_step.png, accuracy_vs_time.png (the RL stage's wall time, resumed legs added
up; each evaluation at the seeds' mean time) and entropy_vs_step.png (the policy's token entropy during the updates): the mean over
seeds as a line, min-max as a band. A "sft_rl" run's curves start at step 0 with the SFT
checkpoint's held-out accuracy.

--points puts finished runs of other sweeps side by side in one report (no --config, no run
starts): `--points='DAPO=<root>/dapo_clip/rl.clip_high=0.28,;GRPO=<root>/grpo/' --root=<out>`,
each entry a label and a workdir prefix whose runs are <prefix>seed=N (their config.json gives
each run's job and steps).
"""

from __future__ import annotations

import datetime
import difflib
import glob
import hashlib
import io
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent import futures
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import cli, logs  # noqa: E402
from rl.config.describe import leaves  # noqa: E402
from rl.core.checks import InputError  # noqa: E402

TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
NAME_CHARS = re.compile(r"[^A-Za-z0-9._=,+-]")
MAX_NAME = 150
JOBS = ("rl", "sft_rl")
PLOTS = {"accuracy_vs_step.png": ("held-out accuracy", "RL step"),
         "accuracy_vs_time.png": ("held-out accuracy", "RL wall time (s)"),
         "entropy_vs_step.png": ("policy entropy (nats/token)", "RL step")}

_CONFIG = cli.define(config_flags.DEFINE_config_file, "config", None,
                     "Base config file (configs/*.py[:arg]) of every run.", lock_config=True)
_GRID = cli.define(
    flags.DEFINE_string, "grid", "", "Grid of overrides: 'field=v1,v2;other.field=v3,v4' (axes "
    "by ';', values by ','); every combination is a grid point. Empty: the base config alone.")
_SEEDS = cli.define(flags.DEFINE_string, "seeds", "0",
                    "Seeds (config.seed) of every grid point, e.g. 0,1,2.")
_ROOT = cli.define(flags.DEFINE_string, "root", None, "Local directory holding one workdir per "
                   "run and the report (sweep.md, sweep.json, *.png).")
_PARALLEL = cli.define(flags.DEFINE_integer, "parallel", 1, "Runs at once.", lower_bound=1)
_TARGET = cli.define(
    flags.DEFINE_float, "target", 0.0, "A held-out accuracy: the table adds each grid point's "
    "steps and RL wall time to reach it (the first evaluation at or above it; 0: no column).",
    lower_bound=0.0, upper_bound=1.0)
_POINTS = cli.define(
    flags.DEFINE_string, "points", "", "Instead of --config and --grid: report finished runs of "
    "other sweeps side by side, 'label=<workdir prefix>;...' (the runs <prefix>seed=N); starts "
    "no run.")
_REPORT_ONLY = cli.define(flags.DEFINE_bool, "report_only", False, "Start no run: rebuild the "
                          "table and plots from the finished runs' workdirs.")

cli.define_help_flags()


@dataclass(frozen=True)
class Run:
  point: str  # the grid point's name ("base" without a grid)
  overrides: tuple[tuple[str, str], ...]  # (field, value) of the grid point
  seed: int
  name: str
  workdir: str
  job: str
  steps: int

  @property
  def log(self) -> str:
    return os.path.join(self.workdir, "train.log")

  @property
  def stage_dir(self) -> str:
    """Where the RL stage writes metrics.jsonl."""
    return os.path.join(self.workdir, "rl") if self.job == "sft_rl" else self.workdir


# ---------------------------------------------------------------------- Grid
def parse_grid(spec: str) -> list[tuple[str, list[str]]]:
  """--grid's axes as (field, values); InputError naming the bad axis."""
  axes: list[tuple[str, list[str]]] = []
  for axis in spec.split(";") if spec.strip() else []:
    field, eq, values = axis.strip().partition("=")
    if not eq or not FIELD.fullmatch(field):
      raise InputError(f"--grid axis {axis.strip()!r}: expected <config field>=<value>,<value>"
                       " (axes separated by ';')")
    if field == "seed":
      raise InputError("--grid axis 'seed': give the seeds with --seeds")
    if field in (f for f, _ in axes):
      raise InputError(f"--grid field {field} is given twice")
    parts = [v.strip() for v in values.split(",")]
    if not all(parts) or len(set(parts)) != len(parts):
      raise InputError(f"--grid axis {axis.strip()!r}: an empty or repeated value")
    axes.append((field, parts))
  return axes


def parse_seeds(spec: str) -> list[int]:
  parts = [p.strip() for p in spec.split(",")]
  if not all(re.fullmatch(r"[0-9]+", p) for p in parts) or len(set(parts)) != len(parts):
    raise InputError(f"--seeds={spec}: expected distinct non-negative integers like 0,1,2")
  return [int(p) for p in parts]


def grid_points(axes: list[tuple[str, list[str]]]) -> list[tuple[tuple[str, str], ...]]:
  """Every combination of the axes' values, the first axis slowest."""
  return [tuple(zip([f for f, _ in axes], values))
          for values in itertools.product(*(v for _, v in axes))]


def safe_name(text: str) -> str:
  """`text` as a directory name: kept as it is when it only holds letters, digits and ._=,+-
  and is short; otherwise those characters kept, the others as "_", cut to MAX_NAME, and a hash
  of the exact text appended, so that distinct texts stay distinct directories."""
  name = NAME_CHARS.sub("_", text)
  if name == text and len(name) <= MAX_NAME:
    return name
  return f"{name[:MAX_NAME]}~{hashlib.sha1(text.encode()).hexdigest()[:8]}"


def point_name(point: tuple[tuple[str, str], ...]) -> str:
  return ",".join(f"{field}={value}" for field, value in point) or "base"


def run_name(point: tuple[tuple[str, str], ...], seed: int) -> str:
  """A run's directory name under --root: its grid point's fields and values, then its seed."""
  return safe_name(",".join([f"{field}={value}" for field, value in point] + [f"seed={seed}"]))


def config_flags_of(point: tuple[tuple[str, str], ...]) -> list[str]:
  return [f"--config.{field}={value}" for field, value in point]


def plan(config_arg: str, overrides: list[str], grid: str, seeds: list[int], root: str) -> list[Run]:
  """Every run of the sweep, each grid point's config built and validated as train.py would
  (InputError naming the point and the problem) before anything runs."""
  from launch.gke.render import job_config
  for flag in overrides:
    if flag.startswith("--config.seed="):
      raise InputError(f"{flag}: give the seeds with --seeds")
  axes = parse_grid(grid)
  try:
    fields = leaves(job_config([f"--config={config_arg}", *overrides]))
  except ValueError as e:
    raise InputError(f"--config={config_arg}: {e}") from None
  for field, _ in axes:
    if field not in fields:
      close = difflib.get_close_matches(field, fields, n=1)
      raise InputError(f"--grid field {field}: not a config field" +
                       (f" (did you mean {close[0]}?)" if close else " (--help lists them)"))
  runs = []
  for point in grid_points(axes):
    where = f"--grid point {point_name(point)}"
    try:
      config = job_config([f"--config={config_arg}", *overrides, *config_flags_of(point)])
    except ValueError as e:
      raise InputError(f"{where}: {e}") from None
    if config.job not in JOBS:
      raise InputError(f"{where}: config.job={config.job!r}; a sweep runs jobs "
                       f"{' or '.join(JOBS)} (it reports the RL stage)")
    if not config.train.eval_every:
      raise InputError(f"{where}: config.train.eval_every=0 leaves no held-out accuracy to "
                       "report; set it")
    for seed in seeds:
      name = run_name(point, seed)
      runs.append(Run(point_name(point), point, seed, name, os.path.join(root, name),
                      config.job, config.train.steps))
  return runs


def runs_of_points(spec: str) -> list[Run]:
  """--points: for each 'label=prefix' entry, the runs <prefix>seed=N as one point `label`, with
  the job and steps their config.json records (InputError naming an entry without runs)."""
  runs = []
  for entry in filter(None, (e.strip() for e in spec.split(";"))):
    label, eq, prefix = entry.partition("=")
    if not (eq and label and prefix):
      raise InputError(f"--points entry {entry!r}: write it label=<workdir prefix>")
    workdirs = [w for w in sorted(glob.glob(glob.escape(prefix) + "seed=*"))
                if w.rsplit("seed=", 1)[1].isdigit()]
    if not workdirs:
      raise InputError(f"--points {label}: no run {prefix}seed=N")
    for workdir in workdirs:
      try:
        with open(os.path.join(workdir, "config.json")) as f:
          config = json.load(f)
      except (OSError, ValueError) as e:
        raise InputError(f"--points {label}: {workdir}/config.json: {e}") from None
      runs.append(Run(label, (), int(workdir.rsplit("seed=", 1)[1]), os.path.basename(workdir),
                      os.path.realpath(workdir), config["job"], config["train"]["steps"]))
  return runs


# ---------------------------------------------------------------------- Run
def is_finished(run: Run) -> bool:
  """Whether the run's trainer saved its last step (see the module docstring)."""
  if run.job == "sft_rl":
    return os.path.isfile(os.path.join(run.workdir, "results.json"))
  return os.path.isdir(os.path.join(run.workdir, "checkpoints", str(run.steps)))


def train_command(run: Run, config_arg: str, overrides: list[str]) -> list[str]:
  return [sys.executable, TRAIN, f"--config={config_arg}", *overrides,
          *config_flags_of(run.overrides), f"--config.seed={run.seed}", f"--workdir={run.workdir}"]


def last_line(path: str, width: int = 200) -> str:
  """The last non-blank line of a log (often the run's `error: ...`), cut to `width`."""
  with open(path, errors="replace") as f:
    lines = [line.strip() for line in f.readlines()[-20:] if line.strip()]
  return lines[-1][:width] if lines else ""


def execute(runs: list[Run], command_of, parallel: int) -> list[Run]:
  """Runs `command_of(run)` for each run not finished, `parallel` at once, each appending to its
  train.log (after a header line naming the start and command); the runs that failed."""
  todo = [r for r in runs if not is_finished(r)]
  logging.info("%d runs: %d finished before, %d to run (%d at once)", len(runs),
               len(runs) - len(todo), len(todo), parallel)

  def one(run: Run) -> bool:
    command = command_of(run)
    os.makedirs(run.workdir, exist_ok=True)
    with open(run.log, "a") as log:
      log.write(f"# sweep: started {datetime.datetime.now().isoformat(timespec='seconds')}: "
                f"{' '.join(command)}\n")
      log.flush()
      logging.info("start %s", run.name)
      status = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    ok = status == 0 and is_finished(run)
    if ok:
      logging.info("done %s", run.name)
    else:
      why = f"exit status {status}" if status else "exited before its last step"
      logging.error("FAILED %s (%s; last line: %s): see %s", run.name, why, last_line(run.log),
                    run.log)
    return ok

  with futures.ThreadPoolExecutor(max_workers=parallel) as pool:
    return [run for run, ok in zip(todo, pool.map(one, todo)) if not ok]


# ---------------------------------------------------------------------- Report
def read_curves(run: Run) -> dict:
  """A finished run's curves from its metrics.jsonl: held-out accuracy by step and by wall time
  (an "sft_rl" run's SFT checkpoint at step 0, time 0), policy entropy by step."""
  rows = []
  with open(os.path.join(run.stage_dir, "metrics.jsonl")) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except ValueError:  # a torn last line of a killed leg
        continue
  evals = [r for r in rows if "heldout_acc" in r]
  acc = {r["step"]: (r["heldout_acc"], r.get("wall_s", float("nan"))) for r in evals}
  sft_eval = os.path.join(run.workdir, "sft", "heldout.json")
  if run.job == "sft_rl" and os.path.isfile(sft_eval):
    with open(sft_eval) as f:
      acc[0] = (json.load(f)["heldout_acc"], 0.0)
  return {"acc": dict(sorted(acc.items())),
          "entropy": {r["step"]: r["entropy"] for r in rows if "entropy" in r},
          "wall_s": rows[-1].get("wall_s", float("nan")) if rows else float("nan")}


def _mean(values: list[float]) -> float:
  return sum(values) / len(values) if values else float("nan")


def _spread(values: list[float]) -> dict:
  return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def _band(curves: list[dict]) -> dict:
  """Mean and min-max over seeds at the steps every seed has: {"x": [...], "mean", "min", "max"}."""
  steps = sorted(set.intersection(*(set(c) for c in curves)))
  per_step = [_spread([c[s] for c in curves]) for s in steps]
  return {"x": steps, **{k: [p[k] for p in per_step] for k in ("mean", "min", "max")}}


def first_reaching(acc: dict, target: float) -> tuple[int, float] | None:
  """(step, wall time) of the first evaluation at or above `target`; None if none is."""
  return next(((step, t) for step, (a, t) in acc.items() if a >= target), None)


def summarise(runs: list[Run], target: float = 0.0) -> list[dict]:
  """One entry per grid point over its finished runs (sweep.json's "points"). With a `target`
  accuracy, each point's "to_target": per seed the (step, wall time) of the first evaluation at
  or above it (None: never), and the mean and min-max over the seeds that reached it."""
  points = []
  for name in dict.fromkeys(r.point for r in runs):
    mine = [r for r in runs if r.point == name]
    done = {r.seed: read_curves(r) for r in mine if is_finished(r)}
    done = {seed: c for seed, c in done.items() if c["acc"]}
    entry = {"point": name, "overrides": dict(mine[0].overrides), "seeds": sorted(done),
             "seeds_asked": [r.seed for r in mine],
             "workdirs": {r.seed: r.workdir for r in mine}}
    if done:
      curves = list(done.values())
      final = {seed: list(c["acc"].values())[-1][0] for seed, c in done.items()}
      entry.update(
          final_heldout_acc={**_spread(list(final.values())), "per_seed": final},
          final_step=max(list(c["acc"])[-1] for c in curves),
          wall_s=_spread([c["wall_s"] for c in curves]),
          acc_vs_step=_band([{s: a for s, (a, _) in c["acc"].items()} for c in curves]),
          entropy_vs_step=_band([c["entropy"] for c in curves]),
          # held-out accuracy averaged over each run's evaluations: the area under its curve
          mean_heldout_acc=_spread([sum(a for a, _ in c["acc"].values()) / len(c["acc"])
                                    for c in curves]),
          # the policy's token entropy averaged over each run's steps, and over its last 5
          mean_entropy=_spread([_mean(list(c["entropy"].values())) for c in curves]),
          final_entropy=_spread([_mean(list(c["entropy"].values())[-5:]) for c in curves]))
      if target:
        hits = {seed: first_reaching(c["acc"], target) for seed, c in done.items()}
        reached = [h for h in hits.values() if h]
        entry["to_target"] = {"target": target, "per_seed": hits, "reached": len(reached)}
        if reached:
          entry["to_target"].update(steps=_spread([h[0] for h in reached]),
                                    wall_s=_spread([h[1] for h in reached]))
      # Against time, each evaluation sits at the seeds' mean wall time when it was taken.
      wall = _band([{s: t for s, (_, t) in c["acc"].items()} for c in curves])
      entry["acc_vs_time"] = {**entry["acc_vs_step"], "x": wall["mean"]}
    points.append(entry)
  return points


def _target_cells(p: dict) -> list[str]:
  """The table's steps-to-target and time-to-target cells: mean [min-max] over the seeds that
  reached it, and how many did."""
  hit = p["to_target"]
  if not hit["reached"]:
    return [f"not reached (0/{len(p['seeds'])})", "-"]
  steps, wall = hit["steps"], hit["wall_s"]
  return [f"{steps['mean']:.1f} [{steps['min']}-{steps['max']}] ({hit['reached']}/"
          f"{len(p['seeds'])})", f"{wall['mean']:.0f} [{wall['min']:.0f}-{wall['max']:.0f}]"]


def markdown(points: list[dict], command: str, target: float = 0.0) -> str:
  header = ["grid point", "seeds", "held-out acc, mean", "min-max", "at step",
            "held-out acc, mean over evaluations", "RL wall time, mean (s)",
            "entropy, mean over steps", "entropy, last 5 steps"]
  if target:
    header += [f"steps to {target:g}", f"wall s to {target:g}"]
  lines = [f"Sweep: `{command}`", "",
           "Final held-out accuracy (greedy) over the finished seeds: mean and min-max."
           + (f" Steps and RL wall time to a held-out accuracy of {target:g}: mean [min-max] over"
              " the seeds that reached it (how many did)." if target else ""), "",
           "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  for p in points:
    seeds = f"{len(p['seeds'])}/{len(p['seeds_asked'])}"
    if not p["seeds"]:
      lines.append(f"| {p['point']} | {seeds} |" + " - |" * (len(header) - 2))
      continue
    acc = p["final_heldout_acc"]
    cells = [p["point"], seeds, f"{acc['mean']:.3f}", f"{acc['min']:.3f}-{acc['max']:.3f}",
             str(p["final_step"]), f"{p['mean_heldout_acc']['mean']:.3f}",
             f"{p['wall_s']['mean']:.0f}", f"{p['mean_entropy']['mean']:.4f}",
             f"{p['final_entropy']['mean']:.4f}"]
    if target:
      cells += _target_cells(p)
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(points: list[dict], key: str, ylabel: str, xlabel: str, path: str) -> None:
  """One line per grid point (mean over seeds), its min-max band shaded."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for p in points:
    if key not in p or not p[key]["x"]:
      continue
    curve = p[key]
    line, = ax.plot(curve["x"], curve["mean"], "o-" if key != "entropy_vs_step" else "-",
                    markersize=3, label=f"{p['point']} ({len(p['seeds'])} seeds)")
    ax.fill_between(curve["x"], curve["min"], curve["max"], color=line.get_color(), alpha=0.2)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=7)
  fig.tight_layout()
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=100)
  plt.close(fig)
  with open(path, "wb") as f:
    f.write(png.getvalue())


def report(runs: list[Run], root: str, command: str, target: float = 0.0) -> list[dict]:
  """Writes sweep.md, sweep.json and the plots under `root`; the points."""
  points = summarise(runs, target)
  os.makedirs(root, exist_ok=True)
  with open(os.path.join(root, "sweep.md"), "w") as f:
    f.write(markdown(points, command, target))
  with open(os.path.join(root, "sweep.json"), "w") as f:
    json.dump({"command": command, "spread": "min-max over the finished seeds",
               "points": points}, f, indent=1)
  keys = ("acc_vs_step", "acc_vs_time", "entropy_vs_step")
  for key, (file, (ylabel, xlabel)) in zip(keys, PLOTS.items()):
    plot(points, key, ylabel, xlabel, os.path.join(root, file))
  return points


# ---------------------------------------------------------------------- Main
def passed_overrides(argv: list[str]) -> list[str]:
  """The --config.a.b=v flags of the command line, as given, for every run."""
  for i, arg in enumerate(argv):
    if arg.startswith("--config.") and "=" not in arg and i + 1 < len(argv):
      raise InputError(f"{arg} {argv[i + 1]}: write overrides as {arg}=<value>")
  return [arg for arg in argv if arg.startswith("--config.")]


def main(argv):
  cli.no_arguments(argv)
  if _POINTS.value:
    if _CONFIG.value is not None or _GRID.value:
      raise InputError("--points reports runs already made: give it without --config and --grid")
    if not _ROOT.value:
      raise InputError("--root=<directory> is required")
    report(runs_of_points(_POINTS.value), os.path.abspath(_ROOT.value),
           shlex.join(["python", "launch/sweep.py"] + sys.argv[1:]), _TARGET.value)
    logging.info("table in %s", os.path.join(os.path.abspath(_ROOT.value), "sweep.md"))
    return
  if _CONFIG.value is None:
    raise InputError("--config=configs/<name>.py is required")
  if not _ROOT.value:
    raise InputError("--root=<directory> is required")
  path, colon, variant = flags.FLAGS["config"].config_filename.partition(":")
  config_arg = os.path.abspath(path) + colon + variant
  overrides = passed_overrides(sys.argv[1:])
  root = os.path.abspath(_ROOT.value)
  if os.path.exists(root) and not os.path.isdir(root):
    raise InputError(f"--root={_ROOT.value} is a file: it must be a directory (or not exist yet)")
  runs = plan(config_arg, overrides, _GRID.value, parse_seeds(_SEEDS.value), root)
  failed = [] if _REPORT_ONLY.value else execute(
      runs, lambda run: train_command(run, config_arg, overrides), _PARALLEL.value)
  command = shlex.join(["python", "launch/sweep.py"] +
                       [a for a in sys.argv[1:] if a != "--report_only"])
  points = report(runs, root, command, _TARGET.value)
  done = sum(len(p["seeds"]) for p in points)
  logging.info("%d of %d runs finished; table in %s", done, len(runs),
               os.path.join(root, "sweep.md"))
  if failed:
    logging.error("%d runs failed: %s", len(failed), ", ".join(r.name for r in failed))
    sys.exit(1)


if __name__ == "__main__":
  logs.run(main, bad_input=(InputError,))
