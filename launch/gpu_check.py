"""The GPU check: one command that runs the project's GPU-facing steps on one GPU, each in its
own time-boxed process, and writes what they measured (docs/gpu.md says how to read it).

  bash launch/gpu_check.sh OUT_DIR                       # on the GPU machine (installs .whl/)
  python -m launch.gpu_check --out=OUT_DIR --smoke       # tiny sizes on CPU: every step runs
  python -m launch.gpu_check --out=OUT_DIR --steps=dsa,rollout --budgets=rollout:300

Steps, in order (launch/gpu_steps.py): env, pytest, dsa, demo, rollout, train. Each has a
time budget in seconds (BUDGETS; --budgets overrides); time a step leaves unused goes to the
next, and the whole run stops by --total seconds (steps not reached are recorded as such). A
step that raises, exits non-zero, or runs out of time is recorded as failed with the tail of
its output, the run goes on to the next step, and the command exits 1 at the end.

Writes OUT_DIR/results.json (per step: status, seconds, rows, notes, output tail), results.md
(one markdown table per step) and steps.log (every step's output).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_NAMES = ("env", "pytest", "dsa", "demo", "rollout", "train")
# Seconds per step, from the H200 runs of 2026-11-28 (docs/gpu.md) with room: env 9 s, dsa 57,
# demo 97, rollout 185, train's 0.5B pair ~100; pytest was still running at 91 s and the 1.5B
# update at 136 s. All six (815 s) do not fit one device call (10 minutes): run them as two
# calls, --steps=env,pytest,dsa,demo (375 s) and --steps=env,rollout,train (455 s), which with
# two machine starts take a session's 15 device minutes (docs/gpu.md).
BUDGETS = {"env": 15, "pytest": 150, "dsa": 80, "demo": 130, "rollout": 200, "train": 240}
SMOKE_TOTAL = 1200  # CI: the fast suite shares 2 cores with everything else


def parse_budgets(text: str) -> dict[str, float]:
  """'demo:300,train:60' -> {"demo": 300.0, "train": 60.0}; unknown steps are an error."""
  budgets = {}
  for part in filter(None, text.split(",")):
    name, _, seconds = part.partition(":")
    if name not in STEP_NAMES:
      raise SystemExit(f"--budgets: unknown step {name!r} (steps: {', '.join(STEP_NAMES)})")
    try:
      budgets[name] = float(seconds)
    except ValueError:
      raise SystemExit(f"--budgets: {part!r} is not step:seconds") from None
  return budgets


def _children_cpu_s() -> float:
  """User + system CPU seconds of this process's finished children (and theirs)."""
  usage = resource.getrusage(resource.RUSAGE_CHILDREN)
  return usage.ru_utime + usage.ru_stime


def run_step(name: str, out: str, smoke: bool, limit: float, log) -> dict:
  """Runs `python -m launch.gpu_steps NAME` in its own process group for at most `limit`
  seconds; returns the step's record (status, seconds, rows, notes, tail of its output)."""
  cmd = [sys.executable, "-m", "launch.gpu_steps", name, f"--out={out}"]
  if smoke:
    cmd.append("--smoke")
  start = time.perf_counter()
  cpu_before = _children_cpu_s()
  proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  try:
    output, _ = proc.communicate(timeout=max(limit, 0.01))
    status = "ok" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)  # the step's process group: its children too
    output, _ = proc.communicate()
    status = f"failed (out of time after {limit:.0f} s)"
  seconds = time.perf_counter() - start
  cpu_s = _children_cpu_s() - cpu_before
  log.write(f"===== {name}: {status}, {seconds:.1f} s\n{output}\n")
  log.flush()
  record = {"status": status, "seconds": seconds, "cpu_s": cpu_s, "limit_s": limit, "rows": [],
            "notes": []}
  path = os.path.join(out, f"{name}.json")
  if os.path.exists(path):
    with open(path) as f:
      record.update(json.load(f))
    os.remove(path)
  if status != "ok":
    record["output_tail"] = output[-4000:]
  return record


def _cell(value) -> str:
  if isinstance(value, float):
    return f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
  return str(value).replace("|", "\\|") if value is not None else "-"


def markdown(results: dict) -> str:
  """One section per step: its status line, notes, and its rows as a table."""
  meta = results["meta"]
  lines = [f"# GPU check {meta['date']}", "",
           f"{meta['device']}; {'smoke mode' if meta['smoke'] else 'full sizes'}; "
           f"{meta['seconds']:.0f} s in all; exit {meta['exit']}", ""]
  for name, step in results["steps"].items():
    lines += [f"## {name}: {step['status']} ({step['seconds']:.0f} s of {step['limit_s']:.0f}; "
              f"CPU {step.get('cpu_s', 0):.0f} s)", ""]
    lines += [f"- {note}" for note in step["notes"]]
    rows = step["rows"]
    if rows:
      columns = list(dict.fromkeys(k for row in rows for k in row))
      lines += ["" if step["notes"] else None, "| " + " | ".join(columns) + " |",
                "|" + "---|" * len(columns)]
      lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    if step.get("output_tail"):
      lines += ["", "```", *step["output_tail"].splitlines()[-15:], "```"]
    lines.append("")
  return "\n".join(line for line in lines if line is not None)


def device_name(results: dict) -> str:
  env = {row.get("what"): row.get("value") for row in results["steps"].get("env", {}).get(
      "rows", [])}
  return env.get("jax device", "device unknown (the env step did not run)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="Directory for results.json/.md, steps.log.")
  parser.add_argument("--smoke", action="store_true", help="Tiny sizes on CPU (CI).")
  parser.add_argument("--steps", default=",".join(STEP_NAMES),
                      help=f"Comma-separated subset of {', '.join(STEP_NAMES)}.")
  parser.add_argument("--budgets", default="", help="Per-step seconds, e.g. demo:300.")
  parser.add_argument("--total", type=float, default=None,
                      help=f"Seconds for the whole run (default: the chosen steps' budgets; "
                      f"smoke {SMOKE_TOTAL}).")
  args = parser.parse_args()
  steps = [s for s in args.steps.split(",") if s]
  unknown = sorted(set(steps) - set(STEP_NAMES))
  if unknown or not steps:
    raise SystemExit(f"--steps: unknown {unknown or 'empty'} (steps: {', '.join(STEP_NAMES)})")
  defaults = {n: SMOKE_TOTAL for n in STEP_NAMES} if args.smoke else BUDGETS
  budgets = {**defaults, **parse_budgets(args.budgets)}
  total = args.total or (SMOKE_TOTAL if args.smoke else sum(budgets[n] for n in steps))
  os.makedirs(args.out, exist_ok=True)
  # Smoke mode is CPU by definition; on the GPU machine, fail at once rather than fall back to
  # the CPU when the CUDA plugin does not load.
  os.environ["JAX_PLATFORMS"] = "cpu" if args.smoke else os.environ.get("JAX_PLATFORMS",
                                                                         "cuda,cpu")
  if args.smoke:  # one device, as on the GPU machine (the test suite forces 8 CPU devices)
    os.environ["XLA_FLAGS"] = " ".join(
        flag for flag in os.environ.get("XLA_FLAGS", "").split()
        if not flag.startswith("--xla_force_host_platform_device_count"))
  # HF generate and the PyTorch step share the GPU with jax: jax takes memory as it needs it.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  os.environ["PYTHONUNBUFFERED"] = "1"
  start = time.perf_counter()
  results = {"steps": {}}
  banked = 0.0
  with open(os.path.join(args.out, "steps.log"), "w") as log:
    for name in STEP_NAMES:
      if name not in steps:
        continue
      left = total - (time.perf_counter() - start)
      if left <= 1:
        results["steps"][name] = {"status": "failed (not reached: the run's time was used up)",
                                  "seconds": 0.0, "limit_s": 0.0, "rows": [], "notes": []}
        continue
      limit = min(budgets[name] + banked, left)
      print(f"[{time.perf_counter() - start:6.1f}s] {name}: up to {limit:.0f} s", flush=True)
      record = run_step(name, args.out, args.smoke, limit, log)
      banked = max(0.0, limit - record["seconds"])
      print(f"[{time.perf_counter() - start:6.1f}s] {name}: {record['status']} in "
            f"{record['seconds']:.1f} s", flush=True)
      if record["status"] != "ok":
        print(record.get("output_tail", "")[-2000:], flush=True)
      results["steps"][name] = record
  failed = [n for n, r in results["steps"].items() if r["status"] != "ok"]
  results["meta"] = {"date": datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y-%m-%d %H:%M UTC"), "smoke": args.smoke, "seconds": time.perf_counter() - start,
      "exit": 1 if failed else 0, "failed": failed, "device": device_name(results),
      "budgets": {n: budgets[n] for n in steps}, "total_s": total}
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=1, default=str)
  text = markdown(results)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(text + "\n")
  print(text, flush=True)
  print(f"{'FAILED: ' + ', '.join(failed) if failed else 'all steps ok'}; "
        f"results in {args.out}", flush=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
