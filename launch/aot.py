"""The RL programs compiled for a mesh, and what the compiler says of them: the policy update
(rl/core/train_step.py) and the rollout engine (rl/rollout/engine.py) lowered from abstract state and
compiled, on the local devices or ahead of time for a TPU slice this host does not have
(`topology_devices`, through libtpu), and the compiler's per-device memory, FLOPs, bytes
accessed and compile time (`analysis`), with the roofline bound they imply on a chip.

launch/dry_run.py builds the abstract state and reports these figures beside its analytic
estimates; launch/train.py and launch/plan.py take `--topology` through `topology_devices`.
"""

from __future__ import annotations

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


def analysis(lowered, platform: str) -> dict[str, float]:
  """Compiles `lowered` and reads the compiler's per-device figures: memory (arguments,
  outputs, aliased, temporaries, peak), FLOPs and bytes accessed (`cost_analysis`), and the
  compile time. When the compiler refuses the program for overflowing HBM, "peak" and "temp"
  are the temporaries it said it needed and "overflow" the HBM it had."""
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
            "compile_seconds": time.perf_counter() - start}
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
  """The devices of a TPU topology such as "v5p:2x2x1" or "v5e:4x4", for ahead-of-time
  compiles on any host (needs libtpu: `bash launch/setup.sh --compilers`)."""
  import importlib.util
  if importlib.util.find_spec("libtpu") is None:
    raise ValueError(f"--topology={name}: libtpu is not installed "
                     "(bash launch/setup.sh --compilers)")
  from jax.experimental import topologies
  return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def roofline_seconds(c: dict[str, float], device) -> float:
  """The step-time lower bound the compiler's per-device FLOPs and bytes imply on `device`
  (a planner.DeviceSpec): max(FLOPs / peak bf16 rate, bytes / HBM bandwidth)."""
  return max(c["flops"] / device.peak_bf16_flops, c["bytes_accessed"] / device.hbm_bandwidth)

