"""Sharding planner (models/planner.py, launch/plan.py): its memory estimate against XLA's
compiled memory analysis on the 8 local CPU devices, the exact parameter accounting, the
ranking order, the remat trade-off, and `config.mesh.auto` in the dry run."""

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from launch import dry_run
from models import planner
from models import sharding as sharding_lib
from rl.config.defaults import base_config
from rl.core.policy import model_config
from rl.config.validation import validate
from rl.parallel import placement

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MESH_AXES = dict(data=1, fsdp=1, expert=1, tensor=1)


def small_config(preset: str, mesh: dict, remat: str, **model):
  c = base_config(preset=preset, algorithm="dapo", remat=remat, **model)
  c.mesh.shape.update(mesh)
  c.rollout.max_new_tokens = 96
  c.rl.overlong_buffer = 0
  c.train.update(prompts_per_step=4, samples_per_prompt=2, mini_batches=1, micro_batches=1)
  c.kernel_backend = "reference"
  return c.lock()


@pytest.mark.parametrize("preset,mesh,remat", [
    ("tiny_dense", dict(data=2, fsdp=2, tensor=2), "none"),
    ("tiny_mla", dict(data=2, fsdp=2, tensor=2), "full"),
    ("tiny_dense", dict(data=4, tensor=2), "names"),
])
def test_memory_estimate_matches_compiled_update(preset, mesh, remat):
  """The planner's per-device bytes of the policy update (parameters, AdamW state, gradients,
  activations of 2 x 128 tokens per device, batch) are within 20% of XLA's compiled peak
  (arguments + outputs - aliased + temporaries) of rl/train_step.make_update on that mesh."""
  config = small_config(preset, mesh, remat)
  compiled = dry_run.report(config, prompt_len=32, compile_step=True)["compiled"]
  plan = planner.estimate(model_config(config), placement.workload(config, prompt_len=32),
                          dict(MESH_AXES, **mesh), planner.DEVICES["h100"], remat)
  assert plan.memory["reference"] == 0
  assert 0.8 < plan.memory["update"] / compiled["peak"] < 1.2, (plan.memory, compiled)


@pytest.mark.parametrize("preset,remat", [("tiny_qwen3_moe", "full"),
                                          ("tiny_moe_mla_dsa", "full")])
def test_memory_estimate_counts_the_expert_exchange(preset, remat):
  """On an expert mesh the planner counts the dropless exchange's buffers (P x k received rows
  per token, models/memory.py exchange_bytes_per_token): its update estimate is within 40% of
  XLA:CPU's compiled peak (0.71 and 0.63 measured; 0.39 and 0.37 without the exchange term).
  XLA:CPU takes the padded exchange; the TPU rows of docs/performance.md are within 25%."""
  mesh = dict(data=1, fsdp=2, expert=4)
  config = small_config(preset, mesh, remat)
  compiled = dry_run.report(config, prompt_len=32, compile_step=True)["compiled"]
  plan = planner.estimate(model_config(config), placement.workload(config, prompt_len=32),
                          dict(MESH_AXES, **mesh), planner.DEVICES["h100"], remat)
  assert 0.6 < plan.memory["update"] / compiled["peak"] < 1.25, (plan.memory, compiled)


def test_parameter_bytes_equal_the_dry_runs_partition_specs():
  """The planner's parameter and optimiser bytes per device are those of the dry run's
  partition specs, under the default logical-axis rules and under a config's own
  (config.mesh.rules), which lay the parameters out differently."""
  params = []
  for rules in ({}, {"embed": "", "mlp": "fsdp,tensor", "experts": ""}):
    config = small_config("tiny_qwen3_moe", dict(data=1, fsdp=2, expert=2, tensor=2), "none")
    config.mesh.rules.update(rules)
    r = dry_run.report(config, prompt_len=32, compile_step=False)
    plan = planner.estimate(model_config(config), placement.workload(config, prompt_len=32),
                            r["mesh_shape"], planner.DEVICES["h100"], "none",
                            rules=sharding_lib.make_rules(config.mesh.rules))
    assert plan.memory["params"] == r["param_bytes_per_device"]
    assert plan.memory["optimizer"] == pytest.approx(r["optimizer_bytes_per_device"], abs=64)
    params.append(plan.memory["params"])
  assert params[1] > params[0]


def test_ranking_fits_first_then_faster_and_remat_trades_time_for_memory():
  """On a device with little memory the ranking lists every fitting plan before the others,
  fitting ones by step time and the rest by memory; full remat needs fewer activation bytes
  and more time than none on the same mesh; offloading the optimiser frees its bytes."""
  config = small_config("tiny_dense", dict(data=-1), "none")
  cfg = model_config(config)
  work = placement.workload(config, prompt_len=32)
  small = dataclasses.replace(planner.DEVICES["h100"], hbm_bytes=2.5e6)
  plans = planner.plan(cfg, work, 8, small, remats=("none", "full"),
                       offload_optimizer=(False, True))
  fits = [p.fits for p in plans]
  assert any(fits) and not all(fits)
  assert fits == sorted(fits, reverse=True)
  fitting = [p for p in plans if p.fits]
  assert [p.step_s for p in fitting] == sorted(p.step_s for p in fitting)
  rest = [p.device_bytes for p in plans if not p.fits]
  assert rest == sorted(rest)
  mesh = dict(MESH_AXES, data=2, fsdp=4)
  none = planner.estimate(cfg, work, mesh, small, "none")
  full = planner.estimate(cfg, work, mesh, small, "full")
  assert full.memory["activations"] < 0.7 * none.memory["activations"]
  assert full.time["compute"] > none.time["compute"]
  offloaded = planner.estimate(cfg, dataclasses.replace(work, offload_optimizer=True), mesh,
                               small, "none")
  assert offloaded.memory["optimizer"] == 0 and offloaded.memory["host"] > 0
  assert offloaded.time["host"] > 0


def test_candidate_meshes_respect_the_model():
  """Expert parallelism only for MoE models and dividing the experts; tensor parallelism
  dividing the heads and inside one NVLink domain."""
  dense = model_config(small_config("tiny_dense", dict(data=-1), "none"))
  moe = model_config(small_config("tiny_qwen3_moe", dict(data=-1), "none"))
  h100 = planner.DEVICES["h100"]
  assert all(m["expert"] == 1 for m in planner.candidate_meshes(dense, 16, h100))
  moe_meshes = planner.candidate_meshes(moe, 16, h100)
  assert {m["expert"] for m in moe_meshes} == {1, 2, 4, 8}
  assert all(m["tensor"] <= 2 for m in moe_meshes)  # gcd(4 heads, 2 kv heads)
  assert all(math.prod(m.values()) == 16 for m in moe_meshes)


def test_mesh_auto_takes_the_best_plan():
  """config.mesh.auto=True: the dry run uses the planner's best mesh for the config's remat
  policy (here 8 H100s; the model is tiny, so every plan fits)."""
  c = base_config(preset="tiny_dense", algorithm="dapo", remat="full")
  c.mesh.update(auto=True, devices=8, device_kind="h100")
  c.rl.overlong_buffer = 0
  c.train.update(prompts_per_step=4, samples_per_prompt=2)
  config = c.lock()
  best = placement.best_mesh(config, 8, planner.DEVICES["h100"])
  r = dry_run.report(config, compile_step=False)
  assert r["planned"] and r["remat"] == "full" and best.remat == "full"
  assert r["mesh_shape"] == best.mesh
  assert "planned: config.mesh.auto" in "\n".join(dry_run.format_report(r))
  # ... and for its optimiser placement (the planner once assumed device-resident state)
  assert not best.offload_optimizer
  with c.unlocked():
    c.optim.offload_state = True
  assert placement.best_mesh(c, 8, planner.DEVICES["h100"]).offload_optimizer
  c.mesh.device_kind = "tpu_v9"
  with pytest.raises(ValueError, match="config.mesh.device_kind='tpu_v9'"):
    validate(c)


def test_device_numbers_are_the_published_ones():
  v5p, h100 = planner.DEVICES["tpu_v5p"], planner.DEVICES["h100"]
  assert (v5p.peak_bf16_flops, v5p.hbm_bandwidth, v5p.hbm_bytes) == (459e12, 2765e9, 95 * 2**30)
  assert (h100.peak_bf16_flops, h100.hbm_bandwidth, h100.hbm_bytes) == (989e12, 3.35e12, 80e9)


@pytest.mark.slow
def test_plan_cli_ranks_the_v32_recipe_on_a_v5p_pod():
  """The CLI on the 671B recipe for 256 TPU v5p chips prints a ranking whose best plan fits."""
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "plan.py"),
       "--config=" + os.path.join(ROOT, "configs", "deepseek_v32_moe_tpu.py"), "--devices=256",
       "--device_kind=tpu_v5p", "--top=5"],
      capture_output=True, text=True, check=True, cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS="cpu")).stdout
  lines = out.splitlines()
  assert "256 x TPU v5p" in lines[0]
  first = lines[3].split()
  assert first[0] == "1" and "yes" in first
