"""Training-step throughput: step time, tokens/s and model FLOPs utilisation (MFU) of the RL
policy update (rl/core/train_step.py: forward + backward + AdamW, gradient accumulation) on a
synthetic mini-batch, printed as one JSON object.

  python launch/bench_train.py --model=tiny_moe_mla_dsa --batch=8 --seq_len=128
  python launch/bench_train.py --model=qwen2.5-0.5b --batch=64 --seq_len=2048 \
      --micro_batches=4 --mesh=fsdp:-1 --output=/tmp/bench.json

MFU = model FLOPs per step / (step time * peak FLOP/s per device * devices). Model FLOPs are
`models.flops.train_flops`: 6 * active matmul parameters * tokens plus causal attention (and
the DSA indexer), i.e. useful work only (padding, masked-out attention and recomputation do
not count). The peak is measured here, on the current device, as the best FLOP/s of a large
jitted square matmul in the model's compute dtype, so MFU is relative to what this device
actually delivers on dense matmuls (below the datasheet on GPUs/TPUs, above it on CPUs whose
datasheets nobody has).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from launch import cli  # noqa: E402
from models import flops as flops_lib  # noqa: E402
from models import sharding as sharding_lib  # noqa: E402
from models.config import get_config  # noqa: E402
from models.transformer import param_counts  # noqa: E402
from rl.core import algorithms  # noqa: E402
from rl.core import train_step as ts  # noqa: E402

_MODEL = cli.define(flags.DEFINE_string, "model", "tiny_moe_mla_dsa", "Model preset (models/config.py).")
_BATCH = flags.DEFINE_integer("batch", 8, "Sequences per mini-batch (one optimiser step).")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 128, "Tokens per sequence (prompt + response).")
_MICRO = flags.DEFINE_integer("micro_batches", 1, "Gradient-accumulation micro-batches.")
_MESH = cli.define(flags.DEFINE_string, "mesh", "fsdp:-1", "Mesh axis sizes, e.g. 'fsdp:4,tensor:2'.")
_ALGORITHM = flags.DEFINE_string("algorithm", "dapo", "RL recipe (rl/core/algorithms.py).")
_REPEATS = cli.define(flags.DEFINE_integer, "repeats", 5, "Timed steps (after one compile step).")
_PEAK_DIM = flags.DEFINE_integer("peak_dim", 0, "Square matmul size for the peak (0: auto).")
_OUTPUT = flags.DEFINE_string("output", "", "Also write the JSON here.")


def parse_mesh(text: str) -> dict[str, int]:
  """'fsdp:4,tensor:2' -> {"fsdp": 4, "tensor": 2}."""
  shape = {}
  for part in filter(None, text.split(",")):
    name, _, size = part.partition(":")
    if not size.lstrip("-").isdigit():
      raise ValueError(f"--mesh={text!r}: expected axis:size pairs, got {part!r}")
    shape[name.strip()] = int(size)
  return shape


def measure_peak_flops(dtype: str, dim: int = 0, repeats: int = 5) -> dict[str, float]:
  """Best FLOP/s of a jitted [dim, dim] @ [dim, dim] matmul on the default device."""
  if not dim:
    dim = 2048 if jax.default_backend() == "cpu" else 8192
  keys = jax.random.split(jax.random.key(0))
  a = jax.random.normal(keys[0], (dim, dim), jnp.float32).astype(dtype)
  b = jax.random.normal(keys[1], (dim, dim), jnp.float32).astype(dtype)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return {"peak_flops_per_device": 2.0 * dim**3 / best, "peak_matmul_dim": dim,
          "peak_matmul_s": best}


def synthetic_minibatch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> dict:
  """Full-length rows: a quarter prompt, the rest response; +-1 advantages."""
  rng = np.random.default_rng(seed)
  pos = np.arange(seq_len)[None, :]
  response = np.broadcast_to(pos >= seq_len // 4, (batch, seq_len)).astype(np.float32)
  acc = rng.integers(0, 2, batch).astype(np.float32)
  return {"tokens": rng.integers(0, vocab, (batch, seq_len), dtype=np.int32),
          "response_mask": response,
          "attention_mask": np.ones((batch, seq_len), np.int32),
          "logp_old": np.full((batch, seq_len), -np.log(vocab), np.float32) * response,
          "advantages": response * (2 * acc - 1)[:, None],
          "acc": acc}


def run_benchmark(model: str, batch: int, seq_len: int, micro_batches: int, mesh_shape: dict,
                  algorithm: str = "dapo", repeats: int = 5, peak_dim: int = 0,
                  overrides: dict | None = None) -> dict:
  """The numbers of the module docstring for preset `model` (with ModelConfig `overrides`)."""
  cfg = get_config(model, **(overrides or {}))
  mesh = sharding_lib.make_mesh(mesh_shape)
  if batch % micro_batches:
    raise ValueError(f"--batch={batch} is not divisible by --micro_batches={micro_batches}")

  start = time.perf_counter()
  module = sharding_lib.shard_model_init(cfg, mesh)
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  optimizer = ts.make_optimizer(lr=1e-6, warmup_steps=1, weight_decay=0.0, grad_clip=1.0)
  state = jax.jit(lambda p: ts.init_state(p, optimizer))(params)
  state_sharding = jax.tree.map(lambda x: x.sharding, state)
  host_batch = synthetic_minibatch(batch, seq_len, cfg.vocab_size)
  batch_sharding = {
      k: sharding_lib.logical_sharding(("batch", "length")[:v.ndim], v.shape, mesh)
      for k, v in host_batch.items()}
  minibatch = jax.device_put(host_batch, batch_sharding)
  update = ts.make_update(ts.policy_objective, graphdef, optimizer,
                          micro_batches=micro_batches, rl=algorithms.recipe(algorithm),
                          state_sharding=state_sharding, batch_sharding=batch_sharding,
                          temperature=1.0, max_len=seq_len)
  with jax.set_mesh(mesh):
    state, metrics = update(state, rest, minibatch)
    float(metrics["loss"])
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      state, metrics = update(state, rest, minibatch)
      float(metrics["loss"])  # waits for the step
      times.append(time.perf_counter() - start)

  step_s = statistics.median(times)
  tokens = batch * seq_len
  model_flops = flops_lib.train_flops(cfg, [seq_len] * batch)
  peak = measure_peak_flops(cfg.dtype, peak_dim)
  devices = mesh.devices.size
  counts = param_counts(cfg)
  return {
      "model": model, "batch": batch, "seq_len": seq_len, "micro_batches": micro_batches,
      "algorithm": algorithm, "mesh": {k: v for k, v in mesh.shape.items() if v > 1},
      "devices": devices, "device_kind": jax.devices()[0].device_kind,
      "backend": jax.default_backend(), "dtype": cfg.dtype,
      "params_total": counts["total"], "params_active": counts["active"],
      "step_time_s": step_s, "step_time_min_s": min(times), "compile_and_first_step_s": compile_s,
      "tokens_per_s": tokens / step_s,
      "model_flops_per_step": model_flops["total"],
      "model_flops_dense": model_flops["dense"],
      "model_flops_attention": model_flops["attention"],
      "achieved_flops_per_s": model_flops["total"] / step_s,
      **peak,
      "mfu": model_flops["total"] / (step_s * peak["peak_flops_per_device"] * devices),
      "final_loss": float(metrics["loss"]),
  }


def main(argv):
  del argv
  result = run_benchmark(_MODEL.value, _BATCH.value, _SEQ_LEN.value, _MICRO.value,
                         parse_mesh(_MESH.value), _ALGORITHM.value, _REPEATS.value,
                         _PEAK_DIM.value)
  text = json.dumps(result, indent=2)
  print(text)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  app.run(main)
