"""The steps of the GPU check (launch/gpu_check.py runs each in its own process, time-boxed, so
one step's device memory, hang or crash does not reach the next): env, pytest, dsa, demo,
rollout, train, and torch_train (the PyTorch side of train, in a process of its own).

  python -m launch.gpu_steps dsa --out=/tmp/gpu_check            # on a GPU
  python -m launch.gpu_steps dsa --out=/tmp/gpu_check --smoke    # tiny sizes, on CPU

Each step writes <out>/<step>.json ({"rows": [...], "notes": [...]}) again after every row, so
a step stopped at its time limit still leaves what it measured. A step fails by raising (exit
status 1): a wrong kernel, a peer that did not start, a test that failed or skipped on a GPU.
What each step measures, and how to read it, is in docs/gpu.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Dense (no structured sparsity) bf16 tensor-core TFLOP/s and HBM TB/s from NVIDIA's spec
# sheets, matched against jax's device_kind, most specific first ("NVIDIA H100 80GB HBM3" is
# the SXM part).
SPEC_SHEET = (("H200 NVL", 835.0, 4.8), ("H200", 989.4, 4.8), ("H100 NVL", 835.0, 3.9),
              ("H100 PCIe", 756.0, 2.0), ("H100", 989.4, 3.35))
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "torch",
            "transformers", "triton", "ml-collections", "grain", "math-verify", "tensorboardX",
            "pytest")


def spec_peaks(device_kind: str) -> tuple[float | None, float | None]:
  """(bf16 dense TFLOP/s, HBM TB/s) of the spec sheet for a jax device_kind; (None, None) for
  a device not listed (a CPU)."""
  for name, tflops, tbps in SPEC_SHEET:
    if name.lower() in device_kind.lower():
      return tflops, tbps
  return None, None


class Recorder:
  """The step's rows and notes, rewritten to <out>/<step>.json after each addition."""

  def __init__(self, out: str, step: str):
    self.path = os.path.join(out, f"{step}.json")
    self.rows: list[dict] = []
    self.notes: list[str] = []

  def row(self, **fields) -> None:
    self.rows.append(fields)
    print(f"  {json.dumps(fields, default=str)}", flush=True)
    self._write()

  def note(self, text: str) -> None:
    self.notes.append(text)
    print(f"  note: {text}", flush=True)
    self._write()

  def _write(self) -> None:
    with open(self.path, "w") as f:
      json.dump({"rows": self.rows, "notes": self.notes}, f, indent=1, default=str)


def device_kind() -> str:
  import jax
  return jax.devices()[0].device_kind


def version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


# ----------------------------------------------------------------------------- 1. env

def step_env(rec: Recorder, smoke: bool) -> None:
  """Versions, the device jax sees and its memory, torch's view of the GPU, the driver."""
  import jax
  rec.row(what="python", value=f"{platform.python_version()} ({sys.executable})")
  for package in PACKAGES:
    rec.row(what=package, value=version(package))
  device = jax.devices()[0]
  rec.row(what="jax backend", value=f"{jax.default_backend()}, {len(jax.devices())} device(s)")
  rec.row(what="jax device", value=device.device_kind)
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    rec.row(what="jax device memory", value=f"{stats['bytes_limit'] / 2**30:.1f} GiB usable")
  tflops, tbps = spec_peaks(device.device_kind)
  rec.row(what="spec-sheet peaks", value=f"{tflops} bf16 dense TFLOP/s, {tbps} TB/s HBM"
          if tflops else "none listed for this device")
  try:
    import torch
    rec.row(what="torch cuda", value=(
        f"{torch.cuda.get_device_name(0)}, "
        f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB"
        if torch.cuda.is_available() else "no GPU visible to torch"))
  except ImportError:
    rec.row(what="torch cuda", value="torch not installed")
  smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                        "--format=csv,noheader"], capture_output=True, text=True, check=False
                       ) if _on_path("nvidia-smi") else None
  rec.row(what="nvidia-smi", value=smi.stdout.strip() if smi and smi.returncode == 0
          else "not available")
  # $SEEDRL_COMMIT, set by the calling session, wins: a device machine's copy of the
  # checkout can carry a .git older than its working tree (seen on the first H200 run).
  commit = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False
                          ) if _on_path("git") else None
  rec.row(what="commit", value=os.environ.get("SEEDRL_COMMIT") or (
      commit.stdout.strip() + " (the device copy's .git)" if commit and commit.returncode == 0
      else "unknown (no git checkout here: name it from the calling session)"))
  if not smoke and jax.default_backend() != "gpu":
    raise RuntimeError(f"jax runs on {jax.default_backend()}, not a GPU: every timing after "
                       "this would be a CPU's")


def readable(line: str) -> bool:
  """False for a line of escaped bytes: Triton and XLA errors can embed a module's bytecode."""
  return "\\x" not in line and line.rstrip("\n").isprintable()


def printable(text: str, limit: int = 400) -> str:
  """The readable, non-empty lines of an error, joined and cut to `limit` characters."""
  lines = [line.strip() for line in str(text).splitlines()]
  return " | ".join(line for line in lines if line and readable(line))[:limit]


def output_tail(proc: subprocess.CompletedProcess, lines: int = 40) -> str:
  """The last `lines` readable lines of a finished subprocess's stdout and stderr."""
  text = [line for line in (proc.stdout + "\n" + proc.stderr).splitlines() if readable(line)]
  return "\n".join(text[-lines:])


def _on_path(program: str) -> bool:
  return any(os.access(os.path.join(d, program), os.X_OK)
             for d in os.environ.get("PATH", "").split(os.pathsep))


# -------------------------------------------------------------------------- 2. pytest

def gpu_test_files() -> list[str]:
  """Test files that carry the gpu marker (so a gpu test added later is run too, and test
  files that import optional packages the GPU machine lacks are not collected)."""
  found = []
  for path in sorted(glob.glob(os.path.join(REPO_ROOT, "tests", "**", "test_*.py"),
                               recursive=True)):
    with open(path) as f:
      if "pytest.mark.gpu" in f.read():
        found.append(os.path.relpath(path, REPO_ROOT))
  return found


def step_pytest(rec: Recorder, smoke: bool) -> None:
  """`pytest -m gpu` on the files holding gpu tests: one row per test. On a GPU a failure, an
  error or a skip (the tests skip when jax does not see a GPU) fails the step; in smoke mode
  the tests are collected only (they need a GPU), and none collected fails it."""
  files = gpu_test_files()
  xml = os.path.join(tempfile.mkdtemp(prefix="gpu_check_pytest_"), "junit.xml")
  cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu", "-rA",
         f"--junitxml={xml}", *files]
  cmd.append("--collect-only" if smoke else "-v")
  print("  " + " ".join(cmd), flush=True)
  # Streamed, and each verdict recorded as it comes: a step stopped at its time limit still
  # shows which tests finished (the second H200 run's pytest step ran out of time silently).
  proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if readable(line):
      print(line, end="", flush=True)
    verdict = re.match(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", line)
    if verdict and not smoke:
      rec.row(test=verdict.group(1), outcome=verdict.group(2).lower(), seconds=None)
  proc.wait()
  if smoke:
    collected = [line for line in lines if "::" in line]
    for test in collected:
      rec.row(test=test.strip(), outcome="collected")
    if proc.returncode != 0 or not collected:
      raise RuntimeError(f"pytest --collect-only -m gpu: exit {proc.returncode}, "
                         f"{len(collected)} collected")
    return
  outcomes = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
  if os.path.exists(xml):
    rec.rows.clear()  # the report's rows replace the streamed ones
    for case in ET.parse(xml).getroot().iter("testcase"):
      outcome = next((child.tag for child in case
                      if child.tag in ("failure", "error", "skipped")), "passed")
      outcome = "failed" if outcome == "failure" else outcome
      outcomes[outcome] += 1
      problem = next((child for child in case if child.tag in ("failure", "error")), None)
      rec.row(test=f"{case.get('classname')}::{case.get('name')}", outcome=outcome,
              seconds=float(case.get("time", 0)),
              **({"error": printable(problem.get("message") or problem.text or "")}
                 if problem is not None else {}))
  rec.note(f"pytest exit {proc.returncode}: " + ", ".join(f"{v} {k}" for k, v in
                                                          outcomes.items()))
  if proc.returncode != 0 or outcomes["skipped"] or not outcomes["passed"]:
    raise RuntimeError(f"pytest -m gpu: exit {proc.returncode}, {outcomes}")


# ----------------------------------------------------------------------------- 3. dsa

@dataclasses.dataclass(frozen=True)
class DSAShape:
  """One sparse-MLA + indexer problem: `batch` rows of `queries` query tokens, the last ones of
  a `context`-long sequence (a whole sequence when queries == context)."""
  name: str
  batch: int
  queries: int
  context: int
  heads: int
  d_v: int
  d_rope: int
  topk: int
  index_heads: int
  index_dim: int
  scale: float


def dsa_shapes(smoke: bool) -> list[DSAShape]:
  """The demo's training forward (configs/demo.py: one RL step's prompts x samples, prompt
  bucket + new tokens long) and DeepSeek-V3.2's prefill (2048 queries at the end of a 32K
  context) and decode (128 sequences, one token, 32K context). Smoke: the demo's at 2 rows
  and a tiny V3.2-like one."""
  from configs import demo
  from launch import bench_dsa
  c = demo.get_config()
  m = c.model
  length = c.rollout.prompt_bucket + c.rollout.max_new_tokens
  demo_shape = DSAShape(
      "demo train forward", 2 if smoke else c.train.prompts_per_step * c.train.samples_per_prompt,
      length, length, m.n_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.index_topk,
      m.index_n_heads, m.index_head_dim, (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5)
  if smoke:
    return [demo_shape, DSAShape("V3.2-like (tiny)", 1, 4, 64, 16, 32, 16, 16, 2, 16, 0.2)]
  return [demo_shape,
          DSAShape("V3.2 prefill", 1, 2048, 32768, 128, 512, 64, 2048, 64, 128,
                   bench_dsa._SCALE),
          DSAShape("V3.2 decode", 128, 1, 32768, 128, 512, 64, 2048, 64, 128,
                   bench_dsa._SCALE)]


def relative_error(got, want) -> float:
  """max |got - want| / max |want| (fp32)."""
  got, want = (np.asarray(x, np.float32) for x in (got, want))
  return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


def set_agreement(got, want) -> float:
  """Mean over queries of |got ∩ want| / |want| over the valid (>= 0) indices."""
  got, want = np.asarray(got).reshape(-1, got.shape[-1]), np.asarray(want).reshape(
      -1, want.shape[-1])
  shares = []
  for g, w in zip(got, want):
    w = w[w >= 0]
    if w.size:
      shares.append(np.intersect1d(g[g >= 0], w).size / w.size)
  return float(np.mean(shares))


def _is_oom(error: Exception) -> bool:
  return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def run_dsa_shape(rec: Recorder, shape: DSAShape, backend: str, iters: int, key,
                  peak_tflops: float | None, tolerance: float,
                  min_agreement: float) -> list[str]:
  """Times the kernels (`backend`) and the plain-jnp reference at `shape` in bf16 and checks
  the kernels against an fp32 reference on a subset (first rows / queries). A kernel that
  fails to compile or run, or is off the reference, gets a row with its error and the next
  op runs; returns those failures."""
  import jax
  import jax.numpy as jnp
  import kernels
  from kernels import reference, sparse_mla_gpu
  from launch import bench_dsa
  s = shape
  dim, dtype = s.d_v + s.d_rope, jnp.bfloat16
  start = s.context - s.queries
  positions = jnp.broadcast_to(jnp.arange(start, s.context), (s.batch, s.queries))
  keys = jax.random.split(key, 7)
  q = jax.random.normal(keys[0], (s.batch, s.queries, s.heads, dim), dtype)
  kv = jax.random.normal(keys[1], (s.batch, s.context, dim), dtype)
  idx = bench_dsa.causal_indices(keys[2], positions, s.topk)
  dout = jax.random.normal(keys[3], (s.batch, s.queries, s.heads, s.d_v), dtype)
  q_i = jax.random.normal(keys[4], (s.batch, s.queries, s.index_heads, s.index_dim), dtype)
  k_i = jax.random.normal(keys[5], (s.batch, s.context, s.index_dim), dtype)
  w_i = jax.random.normal(keys[6], (s.batch, s.queries, s.index_heads), jnp.float32)
  offset = positions[:, 0]
  valid = float(jnp.sum(idx >= 0))
  fwd_flop = 2.0 * valid * s.heads * (dim + s.d_v)
  bwd_flop = 2.0 * valid * s.heads * (3 * dim + 2 * s.d_v)
  index_flop = 2.0 * float(jnp.sum(positions + 1)) * s.index_heads * s.index_dim
  rows, cols = min(s.batch, 8), min(s.queries, 256)  # the checked subset

  def mla(path):
    return lambda q, kv, idx: kernels.sparse_mla(q, kv, idx, scale=s.scale, d_v=s.d_v,
                                                 backend=path)[0]

  def fwd_bwd(path):
    return lambda q, kv, idx, dout: jax.vjp(lambda q, kv: mla(path)(q, kv, idx), q, kv)[1](dout)

  def record(op, path, seconds, flop, **extra):
    tflops = flop / seconds / 1e12
    rec.row(shape=s.name, op=op, path=path, ms=seconds * 1e3, tflops=tflops,
            of_peak=tflops / peak_tflops if peak_tflops else None, **extra)

  sub = (q[:rows, :cols], kv[:rows], idx[:rows, :cols], dout[:rows, :cols])
  f32 = [x.astype(jnp.float32) if x.dtype == dtype else x for x in sub]
  truth_out = jax.jit(mla("reference"))(*f32[:3])
  # Decode (one query per row) is never differentiated: its backward is not timed.
  trained = s.queries > 1
  truth_grads = jax.jit(fwd_bwd("reference"))(*f32) if trained else None
  paths = [("reference", "reference")]
  if sparse_mla_gpu.gpu_supported(dim, s.d_v):
    paths.insert(0, ("kernel", backend))
  else:
    rec.row(shape=s.name, op="sparse_mla", path="kernel",
            note=f"n/a: Triton tiles need d_v and the rope width ({s.d_v}, {s.d_rope}) to be "
                 "powers of two >= 16; 'auto' runs the reference here")
  failures = []

  def attempt(op, label, run) -> None:
    """run(); a kernel's exception is recorded and counted, a reference's out-of-memory is a
    finding (the jnp path cannot hold that shape), any other reference error is raised."""
    try:
      run()
    except Exception as e:
      if label == "kernel":
        rec.row(shape=s.name, op=op, path=label, note="failed", error=printable(e))
        failures.append(f"{s.name} {op}: {printable(e, 200)}")
      elif _is_oom(e):
        rec.row(shape=s.name, op=op, path=label, note=f"out of memory: {printable(e, 200)}")
      else:
        raise

  def check(err):
    if err > tolerance:
      raise AssertionError(f"error {err:.3g} > {tolerance} (relative to the fp32 reference)")

  for label, path in paths:
    forward, backward = jax.jit(mla(path)), jax.jit(fwd_bwd(path))

    def run_forward(forward=forward, label=label):
      err = relative_error(forward(q, kv, idx)[:rows, :cols], truth_out)
      record("sparse_mla fwd", label, bench_dsa.timed(forward, q, kv, idx, iters=iters),
             fwd_flop, err=err)
      if label == "kernel":
        check(err)

    def run_backward(backward=backward, label=label):
      err = max(relative_error(g, t) for g, t in zip(backward(*sub), truth_grads))
      record("sparse_mla fwd+bwd", label, bench_dsa.timed(backward, q, kv, idx, dout,
                                                          iters=iters),
             fwd_flop + bwd_flop, err=err)
      if label == "kernel":
        check(err)

    attempt("sparse_mla fwd", label, run_forward)
    if trained:
      attempt("sparse_mla fwd+bwd", label, run_backward)

  tile_ok = s.index_dim >= 16 and s.index_dim & (s.index_dim - 1) == 0  # as kernels' dispatch
  index_backend = backend if tile_ok else "reference"
  want = jax.jit(lambda q, k, w, o: reference.lightning_indexer(q, k, w, topk=s.topk,
                                                                q_offset=o)[0])(
      q_i[:rows, :cols], k_i[:rows], w_i[:rows, :cols], offset[:rows])
  for label, path in (("kernel", index_backend), ("reference", "reference")):
    if label == "kernel" and path == "reference":
      rec.row(shape=s.name, op="indexer", path="kernel",
              note=f"n/a: indexer head width {s.index_dim} is not a power of two >= 16")
      continue
    index = jax.jit(lambda q, k, w, o, path=path: kernels.lightning_indexer(
        q, k, w, topk=s.topk, q_offset=o, backend=path)[0])

    def run_index(index=index, label=label):
      agreement = set_agreement(index(q_i, k_i, w_i, offset)[:rows, :cols], want)
      record("indexer", label, bench_dsa.timed(index, q_i, k_i, w_i, offset, iters=iters),
             index_flop, set_agreement=agreement)
      if label == "kernel" and agreement < min_agreement:
        raise AssertionError(f"picks {agreement:.4f} of the reference's keys "
                             f"(< {min_agreement})")

    attempt("indexer", label, run_index)
  return failures


def step_dsa(rec: Recorder, smoke: bool) -> None:
  """sparse_mla forward, forward+backward and the lightning indexer, kernel and reference,
  at each `dsa_shapes` shape: time (median), TFLOP/s, fraction of the spec-sheet peak, error."""
  import jax
  backend = "interpret" if smoke else "gpu"
  peak, _ = spec_peaks(device_kind())
  tolerance, min_agreement = 2e-2, 0.99
  rec.note(f"kernels: backend {backend!r}; bf16 inputs; time = median of "
           f"{1 if smoke else 10} runs after a compile run; peak {peak} TFLOP/s (spec sheet, "
           "bf16 dense)")
  rec.note("FLOPs: sparse_mla fwd 2*V*H*(D+dv), bwd 2*V*H*(3D+2dv) (V valid indices, D = dv + "
           "rope); indexer 2*causal keys*HI*DI")
  rec.note(f"err: max|x - fp32 reference| / max|fp32 reference| on the first <= 8 rows x 256 "
           f"queries (fwd+bwd: the worst of dq, dkv); kernels fail above {tolerance}. "
           f"set_agreement: share of the fp32 reference's top-k keys picked; the kernel fails "
           f"below {min_agreement}")
  key = jax.random.key(0)
  failures = []
  for shape in dsa_shapes(smoke):
    key, sub = jax.random.split(key)
    failures += run_dsa_shape(rec, shape, backend, 1 if smoke else 10, sub, peak, tolerance,
                              min_agreement)
  if failures:
    raise RuntimeError(f"{len(failures)} kernel op(s) failed: " + "; ".join(failures))
# ---------------------------------------------------------------------------- 4. demo

# The demo shortened as CI's learning gate is (tests/rl/jobs/test_learning.py): the full SFT
# cold start, then 25 DAPO steps instead of 150, held-out evaluation of both checkpoints.
DEMO_SHORT = ("--config.train.steps=25", "--config.train.eval_every=0",
              "--config.train.checkpoint_every=25")
# Smoke: a few steps of each stage on a few problems.
DEMO_SMOKE = ("--config.train.steps=1", "--config.train.eval_every=0",
              "--config.train.checkpoint_every=1", "--config.data.train_size=64",
              "--config.data.heldout_size=16", "--config.sft.epochs=1",
              "--config.train.prompts_per_step=4", "--config.train.samples_per_prompt=2",
              "--config.rl.max_num_gen_batches=1")


def step_demo(rec: Recorder, smoke: bool) -> None:
  """`launch/train.py --config=configs/demo.py` shortened (DEMO_SHORT): wall time of the
  command, SFT and RL held-out accuracy from its results.json."""
  workdir = tempfile.mkdtemp(prefix="gpu_check_demo_")
  overrides = DEMO_SMOKE if smoke else DEMO_SHORT
  cmd = [sys.executable, os.path.join(REPO_ROOT, "launch", "train.py"),
         "--config=" + os.path.join(REPO_ROOT, "configs", "demo.py"), f"--workdir={workdir}",
         *overrides]
  rec.note("command: " + " ".join(cmd[1:]))
  start = time.perf_counter()
  proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  print(output_tail(proc), flush=True)
  if proc.returncode != 0:
    raise RuntimeError(f"the demo exited {proc.returncode} after {wall:.0f} s: "
                       + printable(output_tail(proc, 3), 300))
  with open(os.path.join(workdir, "results.json")) as f:
    results = json.load(f)
  rec.row(form="smoke" if smoke else "SFT 2,000 steps, RL 25 steps (CI's learning gate)",
          wall_s=wall, sft_heldout_acc=results["sft_heldout_acc"],
          rl_heldout_acc=results["rl_heldout_acc"],
          gain_points=100 * (results["rl_heldout_acc"] - results["sft_heldout_acc"]),
          heldout_problems=results["heldout_size"], train_wall_s=results["wall_s"])


# ------------------------------------------------------------------------- 5. rollout

def device_bandwidth(megabytes: int) -> float:
  """Bytes/s (read + write) of the best of five jitted `x + 1` passes over an fp32 array of
  `megabytes`, on the default device."""
  import jax
  import jax.numpy as jnp
  x = jnp.zeros((megabytes * 2**20 // 4,), jnp.float32)
  step = jax.jit(lambda x: x + 1)
  jax.block_until_ready(step(x))
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    jax.block_until_ready(step(x))
    best = min(best, time.perf_counter() - start)
  return 2 * x.nbytes / best


def rollout_model(smoke: bool):
  """The Qwen2.5-0.5B shape with random weights (smoke: 2 layers, d 64, vocab 512)."""
  from models.transformer import build
  if smoke:
    return build("qwen2.5-0.5b", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, mlp_dim=128,
                 vocab_size=512)
  return build("qwen2.5-0.5b")


def step_rollout(rec: Recorder, smoke: bool) -> None:
  """launch/bench_rollout.py's side-by-side (seedrl's engine beside HF generate on the same
  device, HF in its own process) on the random-weight 0.5B shape: bf16, prompt 64, 128 new
  tokens, greedy, batch 1 / 8 / 32 / 128; the bound from the measured device bandwidth."""
  import jax
  from launch import bench_rollout
  from models import hf
  hf_dir = tempfile.mkdtemp(prefix="gpu_check_qwen05_")
  hf.save_pretrained(rollout_model(smoke), hf_dir, dtype="bfloat16")
  bandwidth = device_bandwidth(16 if smoke else 2048)
  _, spec_tbps = spec_peaks(device_kind())
  rec.note(f"bandwidth: {bandwidth / 1e12:.3f} TB/s measured (jitted x + 1 over "
           f"{16 if smoke else 2048} MiB, read + write)"
           + (f", {spec_tbps} TB/s spec sheet" if spec_tbps else ""))
  on_gpu = jax.default_backend() == "gpu"
  batches = [2] if smoke else [1, 8, 32, 128]
  prompt_len, new_tokens = (8, 8) if smoke else (64, 128)
  rows = bench_rollout.side_by_side(
      hf_dir, batches, prompt_len, new_tokens, compare=["hf"], repeats=1,
      dtype="bfloat16", peer_python=sys.executable, peer_device="cuda" if on_gpu else "cpu",
      bandwidth=bandwidth)
  for row in rows:
    rec.row(**{k: v for k, v in row.items() if k != "tokens"})
  if {row["system"] for row in rows} != {"seedrl", "hf"}:
    raise RuntimeError("HF generate did not run beside the engine (see the log above)")


# --------------------------------------------------------------------------- 6. train

TRAIN_MODELS_ENV = "SEEDRL_GPU_TRAIN_MODELS"  # e.g. "qwen2.5-1.5b": measure only these


def train_shapes(smoke: bool) -> list[tuple[str, dict, int, int]]:
  """(preset, ModelConfig overrides, batch, sequence length) of each update measured: the
  0.5B and 1.5B shapes, or those $SEEDRL_GPU_TRAIN_MODELS names (comma-separated; a rerun
  that has the time for one only)."""
  if smoke:
    return [("qwen2.5-0.5b", dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, mlp_dim=128,
                                  vocab_size=512), 2, 32)]
  shapes = [("qwen2.5-0.5b", {}, 8, 1024), ("qwen2.5-1.5b", {}, 8, 1024)]
  wanted = [name for name in os.environ.get(TRAIN_MODELS_ENV, "").split(",") if name]
  unknown = sorted(set(wanted) - {shape[0] for shape in shapes})
  if unknown:
    raise ValueError(f"${TRAIN_MODELS_ENV}: unknown model(s) {unknown}; "
                     f"choose from {[shape[0] for shape in shapes]}")
  return [shape for shape in shapes if not wanted or shape[0] in wanted]


def step_train(rec: Recorder, smoke: bool) -> None:
  """One RL (DAPO) policy update of launch/bench_train.py per shape, beside a plain PyTorch
  forward-backward-AdamW step of the same HF model at the same batch and length: step time,
  tokens/s, MFU against the spec-sheet peak. Every PyTorch step (torch_train, each in its own
  process) runs before this process touches the device, so each framework has the device to
  itself: jax's allocator keeps what it took (105 GiB after the 0.5B update on the first
  H200 run, and the 1.5B PyTorch step after it ran out of memory)."""
  from launch import bench_train
  from models import flops as flops_lib
  from models.config import get_config
  peak, _ = spec_peaks(device_kind())
  rec.note(f"MFU: models.flops.train_flops (6 x matmul params x tokens + causal attention) / "
           f"step time / {peak} TFLOP/s (spec sheet, bf16 dense); mfu_measured_peak: against "
           "launch/bench_train.py's best jitted matmul on this device")
  shapes = train_shapes(smoke)
  torch_steps = {}
  for preset, overrides, batch, seq_len in shapes:
    torch_json = os.path.join(tempfile.mkdtemp(prefix="gpu_check_torch_"), "torch.json")
    proc = subprocess.run(
        [sys.executable, "-m", "launch.gpu_steps", "torch_train", f"--out={torch_json}",
         f"--preset={preset}", f"--overrides={json.dumps(overrides)}", f"--batch={batch}",
         f"--seq_len={seq_len}"] + (["--smoke"] if smoke else []),
        cwd=REPO_ROOT, capture_output=True, text=True, check=False)
    print(output_tail(proc), flush=True)
    if proc.returncode != 0:
      raise RuntimeError(f"the PyTorch step on {preset} exited {proc.returncode}: "
                         + printable(output_tail(proc, 3), 300))
    with open(torch_json) as f:
      torch_steps[preset] = json.load(f)["step_time_s"]
  for preset, overrides, batch, seq_len in shapes:
    model_flops = flops_lib.train_flops(get_config(preset, **overrides),
                                        [seq_len] * batch)["total"]
    step_s = torch_steps[preset]
    rec.row(model=preset, system="pytorch (eager, AdamW)", batch=batch, seq_len=seq_len,
            step_ms=step_s * 1e3, tokens_per_s=batch * seq_len / step_s,
            mfu=model_flops / step_s / (peak * 1e12) if peak else None)
    result = bench_train.run_benchmark(preset, batch, seq_len, 1, {"fsdp": -1},
                                       repeats=1 if smoke else 3,
                                       peak_dim=512 if smoke else 0, overrides=overrides)
    step_s = result["step_time_s"]
    rec.row(model=preset, system="seedrl (DAPO update)", batch=batch, seq_len=seq_len,
            step_ms=step_s * 1e3, tokens_per_s=result["tokens_per_s"],
            mfu=model_flops / step_s / (peak * 1e12) if peak else None,
            mfu_measured_peak=result["mfu"], compile_s=result["compile_and_first_step_s"])


def torch_train(out: str, preset: str, overrides: dict, batch: int, seq_len: int,
                repeats: int) -> None:
  """The PyTorch side of step_train: the HF model of `preset` (random weights, bf16, SDPA
  attention) on cuda when there is one; per step the sampled tokens' log-probabilities times
  +-1 advantages over the response (the last 3/4, as launch/bench_train.py's batch), backward,
  gradient clipping at 1, AdamW. Writes {"step_time_s": median of `repeats` after one}."""
  import torch
  import transformers
  from models import hf
  from models.config import get_config
  cfg = get_config(preset, **overrides)
  hf_cfg = hf.config_to_hf(cfg)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  config = transformers.AutoConfig.for_model(**hf_cfg)
  with torch.device(device):
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
  model.train()
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
  generator = torch.Generator().manual_seed(0)
  tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=generator).to(device)
  response = (torch.arange(seq_len) >= seq_len // 4).float().to(device)[None, 1:]
  advantages = (torch.randint(0, 2, (batch, 1), generator=generator).float() * 2 - 1).to(device)

  def step():
    logits = model(input_ids=tokens).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    loss = -(logp * advantages * response).sum() / (response.sum() * batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())  # waits for the device

  step()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
  with open(out, "w") as f:
    json.dump({"step_time_s": statistics.median(times), "device": device}, f)


STEPS = {"env": step_env, "pytest": step_pytest, "dsa": step_dsa, "demo": step_demo,
         "rollout": step_rollout, "train": step_train}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("step", choices=[*STEPS, "torch_train"])
  parser.add_argument("--out", required=True, help="Output directory (torch_train: file).")
  parser.add_argument("--smoke", action="store_true", help="Tiny sizes (CPU).")
  parser.add_argument("--preset", help="torch_train: model preset.")
  parser.add_argument("--overrides", default="{}", help="torch_train: ModelConfig overrides.")
  parser.add_argument("--batch", type=int, help="torch_train: sequences per step.")
  parser.add_argument("--seq_len", type=int, help="torch_train: tokens per sequence.")
  args = parser.parse_args()
  if args.step == "torch_train":
    torch_train(args.out, args.preset, json.loads(args.overrides), args.batch, args.seq_len,
                1 if args.smoke else 3)
    return
  os.makedirs(args.out, exist_ok=True)
  STEPS[args.step](Recorder(args.out, args.step), args.smoke)


if __name__ == "__main__":
  main()
