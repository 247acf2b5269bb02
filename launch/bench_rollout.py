"""Rollout throughput: tokens/s of the KV-cached engine, its bandwidth roofline, and (optionally)
the speed-up over recomputing the full forward pass for every new token.

  python launch/bench_rollout.py --model=tiny_dense --batch=8 --prompt_len=32 --response_len=256
  python launch/bench_rollout.py --model=tiny_qwen3_moe --batch=32 --no_naive

Decoding is memory-bound: every step reads the weights once and each row's KV cache. The
roofline step time is (weight bytes + KV bytes per step) / measured bandwidth, with bandwidth
measured here by a large jitted array copy; the achieved fraction is roofline / measured step
time. Two KV figures are printed: the ideal one (each row reads only its valid tokens, mean
context P + M/2) and what this engine reads (the whole fixed-shape [B, P+M] cache every step,
masked). On the tiny models per-step dispatch overhead dominates, so the fraction is small;
it is meaningful for real model sizes on accelerators.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from models import cache as cache_lib  # noqa: E402
from models.transformer import build, param_counts  # noqa: E402
from rl import rollout, sampling  # noqa: E402

_MODEL = flags.DEFINE_string("model", "tiny_dense", "Model preset (models/config.py).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences decoded together.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per sequence.")
_RESPONSE_LEN = flags.DEFINE_integer("response_len", 256, "New tokens per sequence.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs (after one compile run).")
_NAIVE = flags.DEFINE_bool("naive", True, "Also time full-forward-per-token decoding.")


def measure_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
  """Bytes/s of a jitted elementwise pass over a large fp32 array (one read + one write)."""
  x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
  scale = jax.jit(lambda a: a * 1.0001)
  scale(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    scale(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * x.nbytes / best


def naive_decode_fn(graphdef, new_tokens: int, temperature: float):
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
      token, _, _ = sampling.sample(step_keys, logits, temperature=temperature)
      return tokens.at[rows, lens + t].set(token)

    return jax.lax.fori_loop(0, new_tokens, body, tokens)

  return run


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


def benchmark(model_name: str, batch: int, prompt_len: int, response_len: int, *,
              repeats: int = 3, naive: bool = True, log=print) -> dict[str, float]:
  """Runs the benchmark and returns its numbers (also printed through `log`)."""
  model = build(model_name, seed=0)
  graphdef, state = nnx.split(model)
  cfg = model.cfg
  rng = jax.random.key(0)
  prompt_ids = np.asarray(jax.random.randint(jax.random.key(1), (batch, prompt_len), 7, 263),
                          np.int32)
  prompt_lens = np.full((batch,), prompt_len, np.int32)
  rollout_cfg = rollout.RolloutConfig(max_new_tokens=response_len, temperature=1.0,
                                      max_prompt_len=prompt_len)

  def engine_run():
    out = rollout.run_engine(graphdef, state, prompt_ids, prompt_lens, rng, rollout_cfg)
    return jax.block_until_ready(out)

  start = time.perf_counter()
  out = engine_run()
  compile_s = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = engine_run()
    times.append(time.perf_counter() - start)
  cached_s = min(times)
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
      f"device={jax.devices()[0].platform}")
  log(f"cached engine: {generated} tokens in {cached_s:.3f}s = {tokens_per_s:,.0f} tokens/s "
      f"({steps} decode steps, {step_s * 1e3:.3f} ms/step; compile+first run {compile_s:.1f}s)")
  log(f"roofline: weights {weights / 1e6:.2f} MB + KV {kv_ideal / 1e6:.2f} MB (ideal; engine "
      f"reads {kv_full / 1e6:.2f} MB) per step over {bandwidth / 1e9:.1f} GB/s measured = "
      f"{roofline_ideal * 1e3:.4f} ms/step; achieved {results['roofline_fraction']:.1%} of "
      f"roofline ({results['roofline_fraction_engine_reads']:.1%} counting the engine's reads)")

  if naive:
    naive_run = naive_decode_fn(graphdef, response_len, rollout_cfg.temperature)
    buffer = np.pad(prompt_ids, ((0, 0), (0, response_len)))
    jax.block_until_ready(naive_run(state, buffer, prompt_lens, rng))
    start = time.perf_counter()
    naive_tokens = jax.block_until_ready(naive_run(state, buffer, prompt_lens, rng))
    naive_s = time.perf_counter() - start
    same = float(np.mean(np.asarray(naive_tokens) == np.asarray(out["tokens"])))
    results.update(naive_tokens_per_s=batch * response_len / naive_s,
                   speedup=naive_s / cached_s, naive_same_tokens=same)
    log(f"full forward per token: {batch * response_len / naive_s:,.0f} tokens/s "
        f"({naive_s:.3f}s); cached decoding is {naive_s / cached_s:.1f}x faster "
        f"(token agreement with the engine: {same:.1%})")
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  benchmark(_MODEL.value, _BATCH.value, _PROMPT_LEN.value, _RESPONSE_LEN.value,
            repeats=_REPEATS.value, naive=_NAIVE.value)


if __name__ == "__main__":
  app.run(main)
