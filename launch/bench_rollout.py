"""Rollout throughput: tokens/s of the KV-cached engine, its bandwidth roofline, the speed-up over
recomputing the full forward pass for every new token, and a side-by-side against other
generation stacks on the same Hugging Face checkpoint.

  python launch/bench_rollout.py --model=tiny_dense --batches=8 --prompt_len=32 --response_len=256
  python launch/bench_rollout.py --model=tiny_qwen3_moe --batches=32 --nonaive
  python launch/bench_rollout.py --hf_dir=/path/to/Qwen2.5-0.5B --batches=1,8,32 --greedy \
      --prompt_len=64 --response_len=128 --compare=hf,vllm,tunix

Preset mode (--model): decoding is memory-bound: every step reads the weights once and each
row's KV cache. The roofline step time is (weight bytes + KV bytes per step) / bandwidth, with
bandwidth the host's measured copy bandwidth (`measure_bandwidth`); the achieved fraction is
roofline / measured step time. Two KV figures are printed: the ideal one (each row reads only
its valid tokens, mean context P + M/2) and what this engine reads (the whole fixed-shape
[B, P+M] cache every step, masked). On the tiny models per-step dispatch overhead dominates, so
the fraction is small; it is meaningful for real model sizes.

Side-by-side mode (--hf_dir): seedrl (models.hf.load_pretrained + the rollout engine) and each
system of --compare (HF transformers `generate`; vLLM and Tunix when importable; their runners
are in launch/rollout_peers.py) decode the same random prompts (ids in [1, vocab) from --seed; 0
is the pad id) at each --batches size, stop ids off so every row yields exactly --response_len
tokens. Per system and batch: tok/s = B*M / median wall time of --repeats calls after a warm-up
call (prefill included), with the min-max over those calls beside it; TTFT = median wall time of
the same call with one new token (prefill of the batch + its first token; for seedrl an engine run with response_len=1); compile = the
warm-up call's wall time (jit compilation for the JAX systems); busy cores = CPU seconds of the
system's processes (all threads, descendants included) / wall seconds over the timed calls;
fraction of bound = (tok/s / B)
/ (copy bandwidth / weight bytes), i.e. decode steps/s against the weight-read bound (KV reads
ignored, so at large batches the true bound is lower); with --greedy, agreement = fraction of
rows x positions equal to seedrl's tokens and the mean position where a row first differs. A
markdown table for docs/performance.md ends the run.

Every system is given every core this process may use (launch/rollout_peers.py: vLLM without
its reserved frontend CPU, torch one thread per core); the header says which cores each was
given, and the run stops if a peer was given fewer than seedrl uses.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from launch import cli, rollout_peers  # noqa: E402
from models import cache as cache_lib  # noqa: E402
from models import hf  # noqa: E402
from models.transformer import build, param_counts  # noqa: E402
from rl.rollout import engine as rollout_lib  # noqa: E402
from rl.core import sampling

_MODEL = cli.define(flags.DEFINE_string, "model", "tiny_dense", "Model preset (models/config.py).")
_HF_DIR = cli.define(flags.DEFINE_string, "hf_dir", None, "A Hugging Face model directory (config.json + "
                              "safetensors) instead of --model: the side-by-side mode.")
_BATCHES = flags.DEFINE_list("batches", ["8"], "Batch sizes: one run each, same prompts.")
_PROMPT_LEN = cli.define(flags.DEFINE_integer, "prompt_len", 32, "Prompt tokens per sequence.")
_RESPONSE_LEN = flags.DEFINE_integer("response_len", 256, "New tokens per sequence.")
_REPEATS = cli.define(flags.DEFINE_integer, "repeats", 3, "Timed runs (median, after one warm-up run).")
_GREEDY = flags.DEFINE_bool("greedy", False, "Greedy decoding (else temperature 1 sampling); "
                            "stop ids are off either way.")
_TOP_K = cli.define(flags.DEFINE_integer, "top_k", 0, "Sampling: keep the top_k most probable "
                   "ids (0: off), every system; seedrl also records them (keep-sampling-mask).")
_TOP_P = cli.define(flags.DEFINE_float, "top_p", 1.0, "Sampling: the top_p nucleus (after "
                   "top_k), every system.")
_NAIVE = flags.DEFINE_bool("naive", True, "Preset mode: also time full-forward-per-token "
                           "decoding.")
_COMPARE = flags.DEFINE_list("compare", [], "With --hf_dir: other systems on the same "
                             "checkpoint, of hf, vllm, tunix (vllm / tunix only if installed).")
_PEER_PYTHON = flags.DEFINE_string(
    "peer_python", None, "With --compare: run hf and vllm under this Python interpreter (e.g. "
    "vLLM's own virtual environment, which pins its own torch), in a subprocess.")
_DTYPE = cli.define(flags.DEFINE_string, "dtype", "float32", "With --hf_dir: parameter dtype, every system.")
_SEED = cli.define(flags.DEFINE_integer, "seed", 0, "Seed of the random prompt ids.")


# ------------------------------------------------------------------------------ Measuring

def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
  """The host's copy bandwidth in bytes/s (read + write): best of `repeats` np.copyto between
  two preallocated fp32 arrays of `megabytes` each.

  This is the bound for decoding on the CPU. On an accelerator host the bound must come from the
  device (its HBM bandwidth), not from this figure. A jitted elementwise pass is not used: on
  CPU it is limited by XLA's threading, not memory (~5 GB/s on a 2-core host that copies at
  35-43 GB/s), which inflated roofline fractions ~8x.
  """
  src = np.ones((megabytes * 2**20 // 4,), np.float32)
  dst = np.empty_like(src)
  np.copyto(dst, src)  # faults the destination's pages in before timing
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    np.copyto(dst, src)
    best = min(best, time.perf_counter() - start)
  return 2 * src.nbytes / best


def time_calls(call, repeats: int, cpu_clock=None):
  """Returns (seconds of a first warm-up call, median seconds of `repeats` more, last output,
  busy cores, the `repeats` seconds): busy cores = the CPU seconds `cpu_clock()` advanced over
  the timed calls / their wall seconds (how many cores the system kept busy; nan without
  `cpu_clock`)."""
  start = time.perf_counter()
  out = call()
  first_s = time.perf_counter() - start
  times = []
  cpu_start = cpu_clock() if cpu_clock else float("nan")
  for _ in range(repeats):
    start = time.perf_counter()
    out = call()
    times.append(time.perf_counter() - start)
  cpu_s = cpu_clock() - cpu_start if cpu_clock else float("nan")
  return first_s, float(np.median(times)), out, cpu_s / sum(times), times


def random_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> np.ndarray:
  """int32 [batch, prompt_len] ids in [1, vocab_size) (0 is every system's pad id); the first
  rows do not depend on `batch`, so each batch size decodes a prefix of the same prompts."""
  rng = np.random.default_rng(seed)
  return rng.integers(1, vocab_size, size=(batch, prompt_len)).astype(np.int32)


def weight_bytes_per_step(model, batch: int) -> int:
  """Bytes of weights one decode step reads: for MoE, the experts the batch is expected to hit."""
  cfg = model.cfg
  counts = param_counts(cfg)
  itemsize = jnp.dtype(cfg.param_dtype).itemsize
  if not cfg.is_moe:
    return counts["total"] * itemsize
  per_expert = 3 * cfg.d_model * cfg.moe_mlp_dim
  hit = cfg.n_experts * (1 - (1 - cfg.n_experts_per_tok / cfg.n_experts) ** batch)
  all_experts = cfg.n_moe_layers * cfg.n_experts * per_expert
  return int((counts["total"] - all_experts + cfg.n_moe_layers * hit * per_expert) * itemsize)


# ------------------------------------------------------------------------------- seedrl
# A system: `name` and generate(prompt_ids [B, P] int32, new_tokens M) -> tokens [B, M]; the
# others compared with this one are in launch/rollout_peers.py.

GREEDY, SAMPLING = rollout_peers.Decoding(), rollout_peers.Decoding(greedy=False)


class SeedRLEngine:
  """seedrl's rollout engine (rl.rollout.engine.run_engine) on full-width prompts, stop ids off."""

  name = "seedrl"

  def __init__(self, model, decoding: rollout_peers.Decoding):
    # Laid out for decoding once, as vLLM packs its weights once at load (rollout_lib.decode_weights).
    self.graphdef, self.state = rollout_lib.decode_weights(*nnx.split(model))
    self.cores = f"XLA:CPU, cores {rollout_peers.usable_cores()}"
    self.core_count = len(rollout_peers.usable_cores())
    # With top-k, each token's kept ids are recorded as the keep-sampling-mask recipes do (the
    # peers record nothing): that work is counted against seedrl.
    self.cfg = rollout_lib.RolloutConfig(greedy=decoding.greedy, temperature=1.0,
                                         top_k=decoding.top_k, top_p=decoding.top_p,
                                         keep_sampling_mask=decoding.top_k > 0)
    self.rng = jax.random.key(0)

  def run(self, prompt_ids: np.ndarray, new_tokens: int) -> dict:
    """The engine's output dict (tokens [B, P+M], new_count, decode_steps, ...)."""
    batch, prompt_len = prompt_ids.shape
    cfg = self.cfg.replace(max_new_tokens=new_tokens, max_prompt_len=prompt_len)
    out = rollout_lib.run_engine(self.graphdef, self.state, prompt_ids,
                             np.full((batch,), prompt_len, np.int32), self.rng, cfg)
    return jax.block_until_ready(out)

  def generate(self, prompt_ids: np.ndarray, new_tokens: int) -> np.ndarray:
    return np.asarray(self.run(prompt_ids, new_tokens)["tokens"])[:, prompt_ids.shape[1]:]


# ---------------------------------------------------------------------------- Preset mode

def naive_decode_fn(graphdef, new_tokens: int, cfg: rollout_lib.RolloutConfig):
  """Decoding without a cache: each step runs the full forward over the whole [B, P+M] buffer
  and samples from the logits at each row's last position (same RNG streams as the engine)."""

  @jax.jit
  def run(state, tokens, lens, rng):
    model = nnx.merge(graphdef, state)
    rows = jnp.arange(tokens.shape[0])
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, rows)

    def body(t, tokens):
      logits = model.forward(tokens).logits[rows, lens + t - 1]
      step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)
      token, _, _ = sampling.sample(step_keys, logits, temperature=cfg.temperature,
                                    top_p=cfg.top_p, top_k=cfg.top_k, greedy=cfg.greedy)
      return tokens.at[rows, lens + t].set(token)

    return jax.lax.fori_loop(0, new_tokens, body, tokens)

  return run


def benchmark(model_name: str, batch: int, prompt_len: int, response_len: int, *,
              repeats: int = 3, naive: bool = True,
              decoding: rollout_peers.Decoding = SAMPLING, log=print) -> dict[str, float]:
  """Runs the preset benchmark and returns its numbers (also printed through `log`)."""
  model = build(model_name, seed=0)
  cfg = model.cfg
  engine = SeedRLEngine(model, decoding.check())
  prompt_ids = random_prompts(batch, prompt_len, cfg.vocab_size)
  compile_s, cached_s, out, _, _ = time_calls(lambda: engine.run(prompt_ids, response_len),
                                             repeats)
  generated = int(np.asarray(out["new_count"]).sum())
  steps = int(out["decode_steps"])
  tokens_per_s = generated / cached_s
  step_s = cached_s / steps

  bandwidth = measure_bandwidth()
  width = prompt_len + response_len
  weights = weight_bytes_per_step(model, batch)
  kv_full = cache_lib.cache_bytes(cfg, batch, width)
  kv_ideal = kv_full * (prompt_len + response_len / 2) / width
  roofline_ideal = (weights + kv_ideal) / bandwidth
  roofline_engine = (weights + kv_full) / bandwidth
  results = {
      "tokens_per_s": tokens_per_s, "step_ms": step_s * 1e3, "compile_s": compile_s,
      "bandwidth_gbs": bandwidth / 1e9, "weight_mb": weights / 1e6, "kv_ideal_mb": kv_ideal / 1e6,
      "kv_engine_mb": kv_full / 1e6, "roofline_ms": roofline_ideal * 1e3,
      "roofline_fraction": roofline_ideal / step_s,
      "roofline_fraction_engine_reads": roofline_engine / step_s,
  }
  log(f"model={model_name} batch={batch} prompt={prompt_len} response={response_len} "
      f"decoding: {decoding} device={jax.devices()[0].platform}")
  log(f"cached engine: {generated} tokens in {cached_s:.3f}s (median) = {tokens_per_s:,.0f} "
      f"tokens/s ({steps} decode steps, {step_s * 1e3:.3f} ms/step; compile+first run "
      f"{compile_s:.1f}s)")
  log(f"roofline: weights {weights / 1e6:.2f} MB + KV {kv_ideal / 1e6:.2f} MB (ideal; engine "
      f"reads {kv_full / 1e6:.2f} MB) per step over {bandwidth / 1e9:.1f} GB/s (host copy "
      f"bandwidth) = {roofline_ideal * 1e3:.4f} ms/step; achieved "
      f"{results['roofline_fraction']:.1%} of roofline "
      f"({results['roofline_fraction_engine_reads']:.1%} counting the engine's reads)")

  if naive:
    naive_run = naive_decode_fn(engine.graphdef, response_len, engine.cfg)
    buffer = np.pad(prompt_ids, ((0, 0), (0, response_len)))
    prompt_lens = np.full((batch,), prompt_len, np.int32)
    _, naive_s, naive_tokens, _, _ = time_calls(
        lambda: jax.block_until_ready(naive_run(engine.state, buffer, prompt_lens, engine.rng)),
        repeats=1)
    same = float(np.mean(np.asarray(naive_tokens) == np.asarray(out["tokens"])))
    results.update(naive_tokens_per_s=batch * response_len / naive_s,
                   speedup=naive_s / cached_s, naive_same_tokens=same)
    log(f"full forward per token: {batch * response_len / naive_s:,.0f} tokens/s "
        f"({naive_s:.3f}s); cached decoding is {naive_s / cached_s:.1f}x faster "
        f"(token agreement with the engine: {same:.1%})")
  return results


# ------------------------------------------------------------------------- Side by side

def agreement(reference: np.ndarray, tokens: np.ndarray) -> tuple[float, float]:
  """(fraction of [B, M] positions equal, mean over rows of the first differing position; M for
  a row that never differs)."""
  differs = reference != tokens
  first = np.where(differs.any(1), differs.argmax(1), differs.shape[1])
  return float(1 - differs.mean()), float(first.mean())


def measure(system, prompt_ids: np.ndarray, new_tokens: int, repeats: int) -> dict:
  """One system at one batch size: tok/s, TTFT, compile and busy cores (see module docstring)
  + tokens."""
  batch = prompt_ids.shape[0]
  # A peer in another interpreter: its process tree (vLLM's engine runs in a child process);
  # in this process: this process alone (not an idle peer's processes).
  cpu_clock = ((lambda: rollout_peers.cpu_seconds(system.pid)) if hasattr(system, "pid")
               else time.process_time)
  compile_s, run_s, tokens, busy, times = time_calls(
      lambda: system.generate(prompt_ids, new_tokens), repeats, cpu_clock)
  _, ttft_s, _, _, _ = time_calls(lambda: system.generate(prompt_ids, 1), repeats)
  if tokens.shape != (batch, new_tokens):
    raise RuntimeError(f"{system.name} returned tokens {tokens.shape}, expected "
                       f"{(batch, new_tokens)}: it stopped early or padded")
  return {"system": system.name, "batch": batch, "tokens_per_s": batch * new_tokens / run_s,
          "tokens_per_s_range": (batch * new_tokens / max(times), batch * new_tokens / min(times)),
          "ttft_s": ttft_s, "compile_s": compile_s, "busy_cores": busy, "tokens": tokens}


def check_equal_cores(systems) -> list[str]:
  """One header line per system saying which cores / threads it was given; raises when a peer
  was given fewer cores than seedrl (the first system) uses: that comparison would measure the
  peer on part of the machine."""
  seedrl = systems[0]
  for system in systems[1:]:
    if system.core_count < seedrl.core_count:
      raise RuntimeError(
          f"{system.name} was given {system.core_count} cores ({system.cores}) where seedrl uses "
          f"{seedrl.core_count}: not a like-with-like comparison; give it every core")
  return [f"cores: {system.name}: {system.cores} ({system.core_count})" for system in systems]


def host_line(system_names, peer_versions: dict[str, dict[str, str]] | None = None) -> str:
  """CPU model, usable cores, the package versions of the systems run (a peer in another
  interpreter: its own, from `peer_versions`), and today's date."""
  cpu = "unknown cpu"
  if os.path.exists("/proc/cpuinfo"):
    with open("/proc/cpuinfo") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                 cpu)
  peer_versions = peer_versions or {}
  packages = ["jax", "torch", "transformers"] + [
      s for s in ("vllm", "tunix") if s in system_names and s not in peer_versions]
  versions = []
  for package in packages:
    try:
      versions.append(f"{package} {importlib.metadata.version(package)}")
    except importlib.metadata.PackageNotFoundError:
      versions.append(f"{package} not installed")
  for name, found in peer_versions.items():
    listed = ", ".join(f"{package} {version}" for package, version in found.items())
    versions.append(f"{name} in its own interpreter: {listed}")
  return (f"host: {cpu}, nproc {len(os.sched_getaffinity(0))}; {', '.join(versions)}; "
          f"{datetime.date.today().isoformat()}")


def markdown_table(rows: list[dict], greedy: bool) -> str:
  """The side-by-side rows as a markdown table (system | batch | tok/s, median and min-max over
  the timed calls | TTFT | compile | busy cores | fraction of bound | agreement)."""
  lines = ["| system | batch | tok/s, median [min-max] | TTFT | compile | busy cores | "
           "fraction of bound | agreement |", "|---|---:|---:|---:|---:|---:|---:|---|"]
  for row in rows:
    if row["system"] == "seedrl":
      agree = "reference"
    elif not greedy:
      agree = "n/a (sampling)"
    else:
      agree = (f"{row['agreement']:.1%} (rows first differ at {row['first_divergence']:.1f} "
               "on average)" if row["agreement"] < 1 else "100.0%")
    low, high = row["tokens_per_s_range"]
    lines.append(f"| {row['system']} | {row['batch']} | {row['tokens_per_s']:,.1f} "
                 f"[{low:,.1f}-{high:,.1f}] | "
                 f"{row['ttft_s'] * 1e3:,.1f} ms | {row['compile_s']:.2f} s | "
                 f"{row['busy_cores']:.2f} | {row['fraction_of_bound']:.1%} | {agree} |")
  return "\n".join(lines)


def side_by_side(hf_dir: str, batches, prompt_len: int, response_len: int, *,
                 compare=(), decoding: rollout_peers.Decoding = GREEDY,
                 repeats: int = 3, dtype: str = "float32",
                 seed: int = 0, peer_python: str | None = None, peer_device: str = "cpu",
                 bandwidth: float | None = None, log=print) -> list[dict]:
  """seedrl and each system of `compare` on the HF directory `hf_dir` at each batch size.
  `peer_device`: HF's torch device; `bandwidth`: bytes/s of the memory the weights are read
  from (default: the host's copy bandwidth, `measure_bandwidth`; on an accelerator pass its
  own).

  Returns one dict per (batch, system) with system, batch, tokens_per_s, ttft_s, compile_s,
  fraction_of_bound, tokens [B, M] and, for the systems other than seedrl under greedy
  decoding, agreement and first_divergence against seedrl; logs progress, then the header lines
  and the markdown table.
  """
  unknown = sorted(set(compare) - set(rollout_peers.COMPARED))
  if unknown:
    raise ValueError(f"--compare: unknown systems {unknown}; choose from "
                     f"{rollout_peers.COMPARED}")
  start = time.perf_counter()
  model = hf.load_pretrained(hf_dir, dtype=dtype)
  load_s = {"seedrl": time.perf_counter() - start}
  greedy = decoding.check().greedy
  systems = [SeedRLEngine(model, decoding)]
  for name in compare:
    start = time.perf_counter()
    system = rollout_peers.make_system(name, hf_dir, model.cfg, decoding=decoding,
                                       max_len=prompt_len + response_len,
                                       python=peer_python, device=peer_device, log=log)
    if system is not None:
      systems.append(system)
      load_s[name] = time.perf_counter() - start
  core_lines = check_equal_cores(systems)

  bandwidth_source = "host copy bandwidth" if bandwidth is None else "given bandwidth"
  bandwidth = measure_bandwidth() if bandwidth is None else bandwidth
  weights = weight_bytes_per_step(model, 1)
  bound_steps_per_s = bandwidth / weights
  prompts = random_prompts(max(batches), prompt_len, model.cfg.vocab_size, seed)
  rows = []
  for batch in batches:
    reference = None
    for system in systems:
      row = measure(system, prompts[:batch], response_len, repeats)
      row["fraction_of_bound"] = row["tokens_per_s"] / batch / bound_steps_per_s
      if reference is None:
        reference = row["tokens"]
      elif greedy:
        row["agreement"], row["first_divergence"] = agreement(reference, row["tokens"])
      log(f"{system.name} batch {batch}: {row['tokens_per_s']:,.1f} tok/s, TTFT "
          f"{row['ttft_s'] * 1e3:.1f} ms, compile {row['compile_s']:.2f} s")
      rows.append(row)

  params = param_counts(model.cfg)["total"]
  log("")
  log(host_line(load_s, {s.name: s.versions for s in systems if hasattr(s, "versions")}))
  for line in core_lines:
    log(line)
  if "vllm" in compare:
    log("work: every system prefills every call's prompts (vllm: "
        + ", ".join(f"{k}={v}" for k, v in rollout_peers.VLLM_SAME_WORK.items())
        + "; the bench repeats its prompts)")
  if systems[0].cfg.keep_sampling_mask:
    log(f"kept sets: seedrl records each token's {decoding.top_k} kept ids (keep-sampling-mask); "
        "the peers record nothing")
  log("weights: laid out for decoding once at load, not per call (seedrl: "
      "rollout_lib.decode_weights; vLLM packs its own at load)")
  for system in systems:
    if hasattr(system, "close"):
      system.close()
  log(f"model: {hf_dir} ({params / 1e6:.1f}M params, {dtype}); prompt {prompt_len}, response "
      f"{response_len}, {decoding}, stop ids off; tok/s: median "
      f"[min-max] of {repeats} runs after a warm-up")
  log(f"bound at batch 1: {weights / 1e6:.1f} MB of weights / {bandwidth / 1e9:.1f} GB/s "
      f"{bandwidth_source} = {bound_steps_per_s:,.1f} tok/s (fraction of bound: (tok/s / batch) / "
      "this)")
  log("TTFT: the same call with 1 new token (prefill of the batch + its first token; seedrl: "
      "an engine run with response_len=1); compile: the warm-up call; busy cores: CPU seconds "
      "of the system's processes / wall seconds over the timed calls")
  log("load: " + ", ".join(f"{name} {s:.1f}s" for name, s in load_s.items()))
  log("")
  log(markdown_table(rows, greedy))
  return rows


def main(argv):
  cli.no_arguments(argv)
  batches = [int(b) for b in _BATCHES.value]
  try:
    decoding = rollout_peers.Decoding(_GREEDY.value, _TOP_K.value, _TOP_P.value).check()
  except ValueError as e:
    raise app.UsageError(f"--greedy / --top_k / --top_p: {e}") from None
  if _HF_DIR.value:
    if flags.FLAGS["model"].present:
      raise app.UsageError("--model and --hf_dir are alternatives: give one")
    side_by_side(_HF_DIR.value, batches, _PROMPT_LEN.value, _RESPONSE_LEN.value,
                 compare=_COMPARE.value, decoding=decoding, repeats=_REPEATS.value,
                 dtype=_DTYPE.value, seed=_SEED.value, peer_python=_PEER_PYTHON.value)
    return
  if _COMPARE.value:
    raise app.UsageError("--compare needs --hf_dir (the other systems load an HF directory)")
  for batch in batches:
    benchmark(_MODEL.value, batch, _PROMPT_LEN.value, _RESPONSE_LEN.value,
              repeats=_REPEATS.value, naive=_NAIVE.value, decoding=decoding)


if __name__ == "__main__":
  app.run(main)
