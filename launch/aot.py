"""The RL programs compiled for a mesh, and what the compiler says of them: the policy update
(rl/core/train_step.py) and the rollout engine (rl/rollout/engine.py) lowered from abstract state and
compiled, on the local devices or ahead of time for devices this host does not have
(`topology_devices`: a TPU slice through libtpu, or 8-GPU hosts through the CUDA plugin), and
the compiler's per-device memory, FLOPs, bytes accessed and compile time, with what the programs
hold (collectives, compiled kernels; `analysis`) and the roofline bound they imply on a chip.

launch/dry_run.py builds the abstract state and reports these figures beside its analytic
estimates; launch/train.py and launch/plan.py take `--topology` through `topology_devices`.
"""

from __future__ import annotations

import collections
import re
import time

import jax

import kernels
from models import remat as remat_lib
from models.padding import round_up
from rl.core import train_step as ts

# XLA:TPU's refusal, e.g. "the total memory required for HLO temporaries (37.34G) exceeds
# available HBM (31.25G)" (binary units).
_HBM_OVERFLOW = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
                           r"\(([\d.]+)([KMGT])\)")


# A sharding that splits some dimension over a mesh axis: Shardy's `<@mesh, [{"fsdp"}, {}]>`
# (not `[{}, {}]`), or a GSPMD `mhlo.sharding = "{devices=[...]...}"` (not "{replicated}").
_SPLIT = re.compile(r'<@[\w.]+, \[[^\]]*\{"|mhlo\.sharding = "\{devices=')
# Collectives in compiled HLO text: " all-gather-start(" (async) or " all-gather(" (sync); the
# leading space keeps "ragged-all-to-all" apart from "all-to-all".
_COLLECTIVE = re.compile(r" (all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|"
                         r"collective-permute)(?:-start)?\(")
# Kernels by kind: custom-call targets (a Mosaic kernel's "tpu_custom_call", Pallas' Triton call
# "__gpu$xla.gpu.triton", cuBLAS, cuDNN) and XLA:GPU's fusions with a backend kind (Triton GEMMs
# "__triton_nested_gemm_fusion", "__custom_fusion"); XLA's plain loop and reduction fusions have
# none.
_KERNEL = re.compile(r'custom_call_target="([^"]+)"|"fusion_backend_config":\{"kind":"([^"]+)"')


def program_facts(lowered_text: str, compiled_text: str) -> dict:
  """What a program holds: the lowered (StableHLO) text's size and its sharding annotations
  (arguments, results, constraints) that split a dimension over a mesh axis; the compiled
  program's collectives and kernels by kind (counts; empty when it did not compile). A program
  whose sharding was dropped has no split annotations and no FSDP all-gathers; XLA:GPU's Triton
  GEMM fusions appear only in a GPU program."""
  return {
      "stablehlo_chars": len(lowered_text),
      "split_annotations": len(_SPLIT.findall(lowered_text)),
      "collectives": dict(collections.Counter(_COLLECTIVE.findall(compiled_text))),
      "kernels": dict(collections.Counter(a or b for a, b in _KERNEL.findall(compiled_text))),
  }


def analysis(lowered, platform: str) -> dict:
  """Compiles `lowered` and reads the compiler's per-device figures: memory (arguments,
  outputs, aliased, temporaries, peak), FLOPs and bytes accessed (`cost_analysis`; XLA:GPU
  compiling ahead of time gives none: 0), the compile time and `program_facts`. When the
  compiler refuses the program for overflowing HBM, "peak" and "temp" are the temporaries it
  said it needed and "overflow" the HBM it had."""
  # XLA:CPU would otherwise undo the rematerialisation (models/remat.py).
  options = remat_lib.CPU_KEEP_REMAT if platform == "cpu" else None
  start = time.perf_counter()
  try:
    compiled = lowered.compile(compiler_options=options)
  except jax.errors.JaxRuntimeError as e:
    overflow = _HBM_OVERFLOW.search(str(e))
    if overflow is None:
      raise
    # The TPU compiler refuses a program that overflows HBM; what it needed is the figure.
    need, have = (float(overflow[i]) * 1024 ** "KMGT".index(overflow[i + 1]) * 1024
                  for i in (1, 3))
    return {"argument": 0, "output": 0, "alias": 0, "temp": int(need), "peak": int(need),
            "flops": 0.0, "bytes_accessed": 0.0, "overflow": int(have),
            "compile_seconds": time.perf_counter() - start,
            **program_facts(lowered.as_text(), "")}
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
            "temp_size_in_bytes")
  out = {f.replace("_size_in_bytes", ""): int(getattr(memory, f)) for f in fields}
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  cost = compiled.cost_analysis()
  cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
  out["flops"] = float(cost.get("flops", 0.0))
  out["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
  out["compile_seconds"] = seconds
  out.update(program_facts(lowered.as_text(), compiled.as_text()))
  return out


def compile_update(config, mesh, graphdef, state, rest_values, state_shardings, optimizer,
                   batch, batch_shardings) -> dict[str, float]:
  """The policy update (rl/core/train_step.py) compiled for `mesh`: `analysis` per device."""
  update = ts.make_update(
      ts.policy_objective, graphdef, optimizer,
      micro_batches=config.train.micro_batches, rl=config.rl.to_dict(),
      state_sharding=state_shardings, batch_sharding=batch_shardings,
      offload_optimizer=bool(config.optim.offload_state),
      temperature=max(config.rollout.temperature, 1e-6), max_len=config.rollout.max_new_tokens)
  full_batch = {k: jax.ShapeDtypeStruct((v.shape[0] * config.train.micro_batches, *v.shape[1:]),
                                        v.dtype) for k, v in batch.items()}
  platform = mesh.devices.flat[0].platform
  with jax.set_mesh(mesh), kernels.target_platform(platform):
    return analysis(update.lower(state, rest_values, full_batch), platform)


def rollout_shape(config, prompt_len: int) -> dict[str, int]:
  """The rollout engine call the dry run compiles: one step's prompts x samples, each a prompt
  (rounded up to the bucket) plus all of max_new_tokens, each prompt prefilled once for its
  samples (group_size); with streaming rollouts (rl/rollout/streaming.py) the last round of a
  longest sequence: everything but round_tokens already in the context, round_tokens more, and
  no shared prefill (a group's responses differ by then)."""
  r = config.rollout
  sequences = config.train.prompts_per_step * config.train.samples_per_prompt
  if r.streaming.enabled:
    round_tokens = min(r.streaming.round_tokens, r.max_new_tokens)
    context = round_up(prompt_len + r.max_new_tokens - round_tokens, r.prompt_bucket)
    return dict(sequences=sequences, prompt_width=context, new_tokens=round_tokens,
                group_size=1)
  return dict(sequences=sequences, prompt_width=round_up(prompt_len, r.prompt_bucket),
              new_tokens=r.max_new_tokens, group_size=config.train.samples_per_prompt)


def compile_rollout(config, mesh, graphdef, model_state, shape: dict[str, int]
                    ) -> dict[str, float]:
  """The rollout engine (rl/rollout/engine.py: prefill, then the decode loop) for `rollout_shape`,
  compiled for `mesh`: `analysis` per device."""
  from rl.rollout import engine as rollout_lib
  cfg = rollout_lib.run_rollout_config(config)
  platform = mesh.devices.flat[0].platform
  with jax.set_mesh(mesh), kernels.target_platform(platform):
    lowered = rollout_lib.lower_engine(graphdef, model_state, cfg, **shape,
                                       mesh=mesh if mesh.size > 1 else None)
    return analysis(lowered, platform)


def topology_devices(name: str) -> list:
  """Devices to compile for ahead of time on any host: a TPU topology such as "v5p:2x2x1" or
  "v5e:4x4" (needs libtpu), or GPU hosts such as "h100:8" (one host of 8) or "h100:2x8" (needs
  the CUDA plugin, and for compiling a CUDA toolkit's ptxas and libdevice): `bash
  launch/setup.sh --compilers`."""
  import importlib.util
  kind, _, shape = name.partition(":")
  if kind in GPU_TARGETS:
    return gpu_topology_devices(kind, shape)
  if importlib.util.find_spec("libtpu") is None:
    raise ValueError(f"--topology={name}: libtpu is not installed "
                     "(bash launch/setup.sh --compilers)")
  from jax.experimental import topologies
  return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


# What XLA:GPU reads from a GPU it can see, for compiling without one: a
# stream_executor.GpuTargetConfigProto in text format. H100 SXM5 80GB: compute capability 9.0,
# 132 SMs, 228 KiB shared memory per SM (227 KiB to one block), 50 MiB L2, 3.35 TB/s HBM3, the
# 1.98 GHz boost clock (NVIDIA's H100 datasheet and CUDA's device query); 79.1 GiB of device
# memory, the total an H100 80GB HBM3 reports to CUDA (as in XLA's own H100 SXM target
# description); cuDNN 9.8 (the least jax-cuda12-plugin 0.10 asks for).
GPU_TARGETS = {"h100": """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""}


def gpu_topology_devices(kind: str, shape: str) -> list:
  """Compile-only devices of `shape` ("8": one host of 8 GPUs; "2x8": two hosts of 8) GPUs of
  `kind` (a GPU_TARGETS key), through the CUDA plugin's PJRT topology with the kind's target
  description: XLA:GPU lowers, partitions and compiles for them (to PTX and, with ptxas, to
  machine code, without autotuning) and returns its memory analysis; nothing can run."""
  sizes = shape.split("x")
  if not 1 <= len(sizes) <= 2 or not all(s.isdigit() and int(s) > 0 for s in sizes):
    raise ValueError(f"--topology={kind}:{shape}: give GPUs per host (e.g. {kind}:8) or hosts x "
                     f"GPUs per host (e.g. {kind}:2x8)")
  hosts, per_host = (1, int(sizes[0])) if len(sizes) == 1 else map(int, sizes)
  from jax.experimental import topologies
  try:
    return list(topologies.get_topology_desc(
        platform="cuda", target_config=GPU_TARGETS[kind],
        topology=f"1x{hosts}x{per_host}").devices)
  except NotImplementedError as e:  # jax has no CUDA plugin registered
    raise ValueError(
        f"--topology={kind}:{shape}: the jax CUDA plugin is not installed (bash launch/setup.sh "
        "--compilers) or was left out (launch/platforms.py, without --topology)") from e


def roofline_seconds(c: dict[str, float], device) -> float:
  """The step-time lower bound the compiler's per-device FLOPs and bytes imply on `device`
  (a planner.DeviceSpec): max(FLOPs / peak bf16 rate, bytes / HBM bandwidth)."""
  return max(c["flops"] / device.peak_bf16_flops, c["bytes_accessed"] / device.hbm_bandwidth)

