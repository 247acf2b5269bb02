"""Real-compiler gates: every Pallas kernel through XLA:TPU and Mosaic (ahead of time, for TPU
topologies, on this CPU host) and through Pallas' Triton lowering for CUDA; the RL programs of
recipes (policy update and rollout engine) through XLA:TPU for their slice and through XLA:GPU
for their 8-GPU host (compile-only H100 devices, launch/aot.py `topology_devices`).

Interpret mode accepts kernels the real compilers refuse (a bf16 per-row gather at an unaligned
VMEM offset ran on CPU and was rejected by Mosaic), so numerics tests alone prove nothing about
a TPU or GPU. These tests compile (TPU: libtpu's compiler, VMEM and tiling checks included) or
lower (GPU: Triton's block-shape rules; not PTX) the kernels at the shapes the models call them
with: DeepSeek-V3.2 (H=128, latent 512 + rope 64, top-k 2048, 64 x 128 indexer heads) for
prefill / training and decode, and the tiny demo preset, in bf16 and fp32, forward and
backward, alone and under a multi-chip mesh (shard_map).

Marker `compile`, run by `.ci/run` after `bash launch/setup.sh --compilers` (libtpu and the
CUDA plugin; see launch/README.md). Without them these tests skip, except where
SEEDRL_REQUIRE_COMPILERS=1 (CI): then a missing compiler is a failure.
"""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kernels
from models import config as model_config
from models import sharding

pytestmark = pytest.mark.compile

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2")
DTYPES = ("bfloat16", "float32")


def _missing(what: str):
  """Skips, or fails where SEEDRL_REQUIRE_COMPILERS=1 (CI), for want of `what`."""
  if os.environ.get("SEEDRL_REQUIRE_COMPILERS") == "1":
    pytest.fail(f"{what} is not installed (bash launch/setup.sh --compilers)")
  pytest.skip(f"{what} not installed (bash launch/setup.sh --compilers)")


def _need(modules: str | tuple[str, ...], what: str):
  """Skips (fails where SEEDRL_REQUIRE_COMPILERS=1) unless one of `modules` is installed."""
  modules = (modules,) if isinstance(modules, str) else modules
  if all(importlib.util.find_spec(module) is None for module in modules):
    _missing(what)


def _kernel_shapes(preset: str, *, batch: int, steps: int, length: int) -> dict:
  """The kernels' operand shapes for one DSA layer of `preset`."""
  cfg = model_config.get_config(preset)
  return dict(batch=batch, steps=steps, length=length, heads=cfg.n_heads,
              d_v=cfg.kv_lora_rank, d_rope=cfg.qk_rope_head_dim, topk=min(cfg.index_topk, length),
              index_heads=cfg.index_n_heads, index_dim=cfg.index_head_dim,
              scale=cfg.softmax_scale)


SHAPES = {
    # DeepSeek-V3.2 at real width: a 4K training / prefill row and a batch of decode steps.
    "v32_prefill": _kernel_shapes("deepseek-v3.2-671b", batch=1, steps=4096, length=4096),
    "v32_decode": _kernel_shapes("deepseek-v3.2-671b", batch=8, steps=1, length=8192),
    "tiny_prefill": _kernel_shapes("tiny_moe_mla_dsa", batch=4, steps=24, length=24),
}


def _operands(s: dict, dtype: str, sharding=None) -> dict:
  def spec(shape, dt):
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dt), sharding=sharding)
  b, t, length, dim = s["batch"], s["steps"], s["length"], s["d_v"] + s["d_rope"]
  return dict(q=spec((b, t, s["heads"], dim), dtype), kv=spec((b, length, dim), dtype),
              idx=spec((b, t, s["topk"]), "int32"),
              qi=spec((b, t, s["index_heads"], s["index_dim"]), dtype),
              ki=spec((b, length, s["index_dim"]), dtype),
              wi=spec((b, t, s["index_heads"]), "float32"))


def _programs(s: dict, backend: str) -> dict:
  """name -> (function, operand names): the sparse-MLA forward, its backward (d q, d kv; not
  for decode, which is never differentiated) and the indexer (causal, the queries at the end
  of the cache)."""
  def attend(q, kv, idx):
    return kernels.sparse_mla(q, kv, idx, scale=s["scale"], d_v=s["d_v"], backend=backend)

  def loss(q, kv, idx):
    out, lse = attend(q, kv, idx)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  def index(qi, ki, wi):
    return kernels.lightning_indexer(qi, ki, wi, topk=s["topk"],
                                     q_offset=s["length"] - s["steps"], backend=backend)
  programs = {"sparse_mla_fwd": (attend, ("q", "kv", "idx")),
              "indexer": (index, ("qi", "ki", "wi"))}
  if s["steps"] > 1:
    programs["sparse_mla_bwd"] = (jax.grad(loss, argnums=(0, 1)), ("q", "kv", "idx"))
  return programs


@pytest.fixture(scope="module")
def tpu_topologies():
  _need("libtpu", "libtpu (the XLA:TPU compiler)")
  from jax.experimental import topologies
  return {name: topologies.get_topology_desc(platform="tpu", topology_name=name)
          for name in TOPOLOGIES}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_tpu_kernels_compile(topology, dtype, shape, tpu_topologies):
  """Mosaic accepts every TPU kernel (forward, backward, indexer) on one chip of each
  generation; the compiler's own memory analysis comes back."""
  device = tpu_topologies[topology].devices[0]
  one_chip = NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), P())
  ops = _operands(SHAPES[shape], dtype, one_chip)
  for name, (fn, args) in _programs(SHAPES[shape], "tpu").items():
    compiled = jax.jit(fn).lower(*(ops[a] for a in args)).compile()
    assert compiled.memory_analysis() is not None, (topology, dtype, shape, name)


@pytest.mark.parametrize("shape", ["v32_prefill", "tiny_prefill"])
def test_tpu_kernels_compile_on_a_sharded_mesh(shape, tpu_topologies):
  """On a 4-chip v5p mesh (data 2 x tensor 2, rows sharded) the kernels compile: they run per
  shard inside shard_map, since XLA cannot partition a Mosaic call."""
  mesh = sharding.make_mesh({"data": 2, "tensor": 2}, tpu_topologies["v5p:2x2x1"].devices)
  rows = NamedSharding(mesh, P("data"))
  s = dict(SHAPES[shape], batch=4)
  ops = _operands(s, "bfloat16", rows)
  with jax.set_mesh(mesh):
    for name, (fn, args) in _programs(s, "tpu").items():
      hlo = jax.jit(fn).lower(*(ops[a] for a in args)).compile().as_text()
      assert "tpu_custom_call" in hlo, (shape, name)


@pytest.fixture
def verified_triton_modules(monkeypatch):
  """Runs the MLIR verifier on every Triton module Pallas lowers while the test runs, and
  returns the names of the kernels seen. Lowering alone serialises a module the GPU then refuses:
  the first H200 run's indexer failed there ("'scf.for' op failed to verify"), and this check
  fails on that kernel here, on the CPU pin's jax 0.10 as on 0.11 (private API:
  jax._src.pallas.triton)."""
  from jax._src.lib.mlir import ir
  from jax._src.pallas.triton import pallas_call_registration as registration
  lower = registration.lowering.lower_jaxpr_to_triton_module
  seen = []

  def lower_and_verify(*args, **kwargs):
    result = lower(*args, **kwargs)
    result.module.operation.verify()  # raises with the verifier's message
    seen.append(ir.StringAttr(result.module.operation.attributes["sym_name"]).value)
    return result
  monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", lower_and_verify)
  return seen


@pytest.mark.parametrize("shape", ["v32_prefill", "v32_decode"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_kernels_lower_to_triton(dtype, shape, verified_triton_modules):
  """Pallas' Triton lowering for CUDA takes the GPU kernels (power-of-two tiles, block rules)
  and every Triton module it writes passes the MLIR verifier: lowering, not PTX compilation.
  Shapes the tiles cannot take are refused by the dispatcher (and "auto" takes the reference
  for them; test_kernels.py::test_dispatch)."""
  # jax 0.10 (the CPU pin) comes with the CUDA 12 plugin, jax 0.11 (the GPU machine) with 13.
  _need(("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"), "a jax CUDA plugin (CUDA lowering)")
  s = SHAPES[shape]
  ops = _operands(s, dtype)
  # The target GPU: jax 0.11's Triton lowering reads it from the abstract mesh's device on a
  # host without one (and raises without it); jax 0.10 took compute capability 9.0.
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                     platform="gpu")
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",),
                                                                abstract_device=h100)):
    for name, (fn, args) in _programs(s, "gpu").items():
      text = jax.jit(fn).trace(*(ops[a] for a in args)).lower(
          lowering_platforms=("cuda",)).as_text()
      assert "triton" in text, (dtype, shape, name)
  # sparse_mla forward, its backward (not for decode) and the indexer's score kernel
  assert set(verified_triton_modules) == {"sparse_mla_fwd", "lightning_indexer_scores"} | (
      set() if shape == "v32_decode" else {"sparse_mla_bwd"})


def test_dry_run_compiles_the_rl_update_for_a_tpu_slice(tpu_topologies):
  """`train.py --dry_run --topology=v5p:2x2x1`: the demo's policy update (tiny MoE + MLA + DSA,
  DAPO) compiled by XLA:TPU for a 4-chip slice with the config's mesh and the Mosaic kernels,
  its per-chip memory from the compiler beside the analytic estimate."""
  import ml_collections
  from configs import demo
  from launch import dry_run
  c = ml_collections.ConfigDict(demo.get_config().to_dict())
  c.train.prompts_per_step, c.train.samples_per_prompt = 4, 2
  c.mesh.shape.update(data=4, fsdp=1, expert=1, tensor=1)
  r = dry_run.report(c, compile_step=True, prompt_len=16,
                     devices=list(tpu_topologies["v5p:2x2x1"].devices))
  assert r["platform"] == "tpu" and r["devices"] == 4
  assert r["compiled"]["peak"] > 0 and r["compiled"]["flops"] > 0
  assert r["compiled_rollout"]["peak"] > 0  # the rollout engine compiled for the slice too
  text = dry_run.format_report(r)
  assert any(line.startswith("compiled") and "XLA:tpu" in line for line in text)
  assert any(line.startswith("rollout") and "TPU v5p holds 95.00 GiB" in line for line in text)
  assert any("roofline" in line and "compiled, not run" in line for line in text)


def test_moe_recipe_at_reduced_depth_compiles_for_its_slice():
  """`configs/qwen3_moe_dapo.py` at 2 of its 48 layers (both one scanned stack), compiled by
  XLA:TPU for the recipe's slice, v5p:2x2x4 (16 chips, fsdp 2 x expert 8) through the dry run:
  the update fits a v5p chip, the report gives the model's FLOPs beside the compiled ones
  (a scan's body counts once), and the rollout compiles. The full-depth figures are in
  docs/performance.md (48 layers: 84.3 GiB update, 59.9 GiB rollout)."""
  _need("libtpu", "libtpu (the XLA:TPU compiler)")
  import ml_collections
  from configs import qwen3_moe_dapo
  from jax.experimental import topologies
  from launch import dry_run
  c = ml_collections.ConfigDict(qwen3_moe_dapo.get_config().to_dict())
  c.model.n_layers = 2
  devices = list(topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x4").devices)
  # conftest's "highest" matmul precision makes Mosaic refuse the bf16 grouped matmul.
  with jax.default_matmul_precision("default"):
    r = dry_run.report(c, compile_step=True, devices=devices)
  assert r["devices"] == 16 and r["platform"] == "tpu"
  assert 0 < r["compiled"]["peak"] <= 95 * 2**30
  assert r["compiled_rollout"]["peak"] > 0
  text = dry_run.format_report(r)
  assert any("compiled / model" in line for line in text)


def test_planner_defers_to_the_compiler_on_a_tpu_slice(tpu_topologies):
  """`launch/plan.py --topology=v5p:2x2x1`: the planner's best plans for the demo compiled for
  the slice, each with the compiler's update and rollout peaks and the planner/compiler ratio;
  the ones the compiler says fit come first."""
  import ml_collections
  from configs import demo
  from launch import dry_run
  from models import planner
  from rl.core.policy import model_config
  from rl.parallel import placement
  c = ml_collections.ConfigDict(demo.get_config().to_dict())
  c.train.prompts_per_step, c.train.samples_per_prompt = 4, 2
  devices = list(tpu_topologies["v5p:2x2x1"].devices)
  device = planner.spec_of(devices[0])
  assert device.name == "TPU v5p"
  plans = planner.plan(model_config(c), placement.workload(c), len(devices), device,
                       remats=("none",))
  rows = dry_run.verify_plans(c, plans, devices, top=2)
  assert [row["rank"] for row in rows if row["fits"]] == sorted(
      row["rank"] for row in rows if row["fits"])
  for row in rows:
    assert row["update"] > 0 and row["rollout"] > 0 and row["ratio_update"] > 0
  assert len(dry_run.format_verified(rows, device.hbm_bytes)) == 3


def test_tpu_expert_exchange_ragged_and_bounded(tpu_topologies):
  """Expert parallelism compiled by XLA:TPU for a v5p expert mesh (4 chips), forward and
  backward: the target platform picks the ragged exchange (`ragged_all_to_all` in the compiled
  program), and a capacity factor of 1.0 (bounded exchange) compiles too and needs fewer
  temporary bytes than dropless."""
  import functools
  from models import moe_ep
  mesh = jax.sharding.Mesh(np.array(tpu_topologies["v5p:2x2x1"].devices).reshape(4), ("expert",))
  n, dim, hidden, n_experts, k = 4096, 512, 256, 16, 4
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)  # noqa: E731
  args = (spec(n, dim), jax.ShapeDtypeStruct((n, k), jnp.int32), spec(n, k),
          spec(n_experts, dim, hidden), spec(n_experts, dim, hidden),
          spec(n_experts, hidden, dim))
  temporaries = {}
  for factor in (0.0, 1.0):
    ep = functools.partial(moe_ep.expert_parallel_experts, mesh=mesh, capacity_factor=factor)

    def loss(x, ids, weights, *w, ep=ep):
      return jnp.sum(ep(x, ids, weights, *w).astype(jnp.float32) ** 2)

    # Default matmul precision, as in a run: conftest.py's "highest" asks Mosaic's grouped
    # matmul for fp32 passes on bf16 operands, which it refuses ("Bad lhs type").
    with (jax.set_mesh(mesh), kernels.target_platform("tpu"),
          jax.default_matmul_precision("default")):
      compiled = jax.jit(jax.grad(loss, argnums=(0, 3))).lower(*args).compile()
    assert "ragged-all-to-all" in compiled.as_text() or "ragged_all_to_all" in compiled.as_text()
    temporaries[factor] = compiled.memory_analysis().temp_size_in_bytes
  assert temporaries[1.0] < temporaries[0.0], temporaries


GPU_RECIPES = ("qwen2_5_math_dapo:1.5b", "qwen2_5_math_dapo:7b", "vapo_qwen:1.5b")


@pytest.fixture(scope="module")
def h100_host():
  """8 compile-only H100s, once XLA:GPU has compiled a small program for them to machine code
  (the CUDA plugin, then ptxas and libdevice: a CUDA toolkit or nvcc's wheel)."""
  _need(("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13"), "a jax CUDA plugin (XLA:GPU)")
  from launch import aot
  devices = aot.topology_devices("h100:8")
  rows = NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P("x"))
  try:
    jax.jit(jnp.tanh).lower(jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=rows)).compile()
  except jax.errors.JaxRuntimeError as e:  # e.g. "INTERNAL: libdevice not found at ..."
    _missing(f"CUDA's ptxas / libdevice for XLA:GPU ({str(e).splitlines()[0]})")
  return devices


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_gpu_recipe_at_reduced_depth_compiles_for_its_host(recipe, h100_host, monkeypatch):
  """A GPU recipe at 2 of its layers (one scanned stack; batch, lengths, dtypes, mesh and
  algorithm as configured): its policy update and rollout engine lowered for CUDA and compiled
  by XLA:GPU for 8 H100s through the dry run, as `train.py --dry_run --topology=h100:8` does.
  Every platform question the models and the engine ask while tracing is answered "gpu" (their
  CPU-only bodies are not taken); both programs are sharded (no large parameter left whole,
  annotations that split dimensions over mesh axes, tensor parallelism's all-reduces, FSDP's
  all-gathers and reduce-scatters in the update, whose per-device arguments are the sharded
  state, not the whole); their products are XLA:GPU's GEMM kernels; both fit an H100 by the
  compiler's memory analysis, and the dry run's analytic rollout total is near its peak (full
  depth: docs/performance.md)."""
  import importlib
  import ml_collections
  from launch import dry_run
  from models import planner
  module, arg = recipe.split(":")
  recipe_config = importlib.import_module(f"configs.{module}").get_config(arg)
  c = ml_collections.ConfigDict(recipe_config.to_dict())
  c.model.n_layers = 2
  answers = []  # kernels.platform() as the models and the engine see it while tracing
  platform = kernels.platform

  def recorded_platform():
    answers.append(platform())
    return answers[-1]
  monkeypatch.setattr(kernels, "platform", recorded_platform)
  r = dry_run.report(c, compile_step=True, devices=h100_host)
  assert r["platform"] == "gpu" and r["devices"] == 8 and not r["abstract_mesh"]
  assert {axis: r["mesh_shape"][axis] for axis in c.mesh.shape} == c.mesh.shape.to_dict()
  assert answers and set(answers) == {"gpu"}, sorted(set(answers))
  assert not r["replicated_params"], r["replicated_params"]
  update, rollout = r["compiled"], r["compiled_rollout"]
  hbm = planner.spec_of(h100_host[0]).hbm_bytes
  for program in (update, rollout):
    assert 0 < program["peak"] <= hbm
    assert program["split_annotations"] > 0 and program["collectives"].get("all-reduce")
    # XLA:GPU's GEMMs: Triton fusions (what jax 0.10 picks without autotuning) or cuBLAS calls.
    assert any(kind.startswith(("__triton", "__cublas")) for kind in program["kernels"]), (
        program["kernels"])
  assert update["collectives"].get("all-gather") and update["collectives"].get("reduce-scatter")
  # The dry run's analytic rollout (the state, the slots' KV cache, one refill's shared prefill)
  # is the compiler's peak within a factor 2 (full depth: 1.04 for the 1.5B recipe).
  assert 0.5 < r["rollout_total_bytes_per_device"] / rollout["peak"] < 2, (
      r["rollout_total_bytes_per_device"], rollout["peak"])
  sharded_state = r["param_bytes_per_device"] + r["optimizer_bytes_per_device"]
  assert sharded_state <= update["argument"] <= 1.5 * sharded_state + r["batch_bytes_per_device"]
