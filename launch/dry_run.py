"""Dry run of a training config: the mesh, the policy and its optimiser built abstractly (nothing
is allocated), parameter counts and the memory each device would hold.

  python launch/train.py --config=configs/deepseek_v32_moe_tpu.py --dry_run

`report(config)` returns the numbers as a dict and `format_report` the printed lines. The mesh
is `config.mesh`; when it needs more devices than this machine has (a 256-chip TPU slice checked
on a laptop) it is a `jax.sharding.AbstractMesh` and every per-device size comes from the array's
partition spec under the logical-axis rules of models/sharding.py. When the mesh fits on the local
devices (or `--topology` names a TPU slice: libtpu compiles for it ahead of time), the policy
update (rl/core/train_step.py) and the rollout engine (rl/rollout/engine.py) are also compiled for it and the
compiler's per-device memory, FLOPs and bytes are reported, with the chip's HBM and the roofline
bound they imply; otherwise the activation memory is an analytic estimate, labelled as such (see
models/memory.py `activation_bytes_per_token`). The compiling itself is launch/aot.py's; this
module builds the abstract state it compiles and prints the report. `verify_plans` runs the report
for the planner's best plans (launch/plan.py --topology).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from launch import aot
from models import cache as cache_lib
from models import flops as flops_lib
from models import memory
from models import planner
from models import sharding as sharding_lib
from models.config import ModelConfig
from rl.config.describe import describe_model, describe_rl
from rl.core.policy import model_config
from rl.config.validation import validate
from rl.parallel import placement as placement_lib
from rl.core import algorithms
from rl.core import train_step as ts
from rl.core import batching as batching_lib

GiB = 2**30


def mesh_for(config: ml_collections.ConfigDict, shape: dict[str, int] | None = None,
             devices: list | None = None) -> tuple[Any, bool]:
  """(mesh, concrete): a real Mesh over the first of `devices` (default: the local devices)
  when config.mesh (or `shape`, e.g. a planned one) fits on them, else an AbstractMesh of the
  same axis sizes. A -1 size takes the devices left over."""
  devices = list(jax.devices() if devices is None else devices)
  shape = config.mesh.shape if shape is None else shape
  ici = {a: int(shape.get(a, 1)) for a in sharding_lib.MESH_AXES}
  dcn = {a: int(config.mesh.dcn.get(a, 1)) for a in sharding_lib.MESH_AXES}
  n_local = len(devices)
  if -1 in ici.values():
    known = math.prod(s for s in ici.values() if s != -1) * math.prod(dcn.values())
    if n_local % known:
      raise ValueError(f"config.mesh: {n_local} local devices do not split into the fixed axes "
                       f"({known} devices); give every axis a size to size a bigger mesh")
    ici = {a: n_local // known if s == -1 else s for a, s in ici.items()}
  total = math.prod(ici.values()) * math.prod(dcn.values())
  if total <= n_local:
    return sharding_lib.mesh_from_config(dict(ici, dcn=dcn), devices[:total]), True
  sizes = tuple(ici[a] * dcn[a] for a in sharding_lib.MESH_AXES)
  return AbstractMesh(sizes, sharding_lib.MESH_AXES,
                      axis_types=(AxisType.Auto,) * len(sizes)), False


def micro_batch_rows(config) -> int:
  c = config.train
  return c.prompts_per_step * c.samples_per_prompt // (c.mini_batches * c.micro_batches)


def batch_spec(config, cfg: ModelConfig, rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The policy update's mini-batch fields (rl/jobs/trainer.py `build_batch`) for `rows` sequences."""
  f32, bt = jnp.float32, (rows, length)
  batch = {"tokens": jax.ShapeDtypeStruct(bt, jnp.int32),
           "response_mask": jax.ShapeDtypeStruct(bt, f32),
           "attention_mask": jax.ShapeDtypeStruct(bt, f32),
           "logp_old": jax.ShapeDtypeStruct(bt, f32),
           "advantages": jax.ShapeDtypeStruct(bt, f32),
           "acc": jax.ShapeDtypeStruct((rows,), f32)}
  rl = config.rl
  if rl.keep_routing and cfg.is_moe:
    batch["routing"] = jax.ShapeDtypeStruct((*bt, cfg.n_moe_layers, cfg.n_experts_per_tok),
                                            jnp.int32)
  kept_width = placement_lib.workload(config).kept_ids
  if kept_width:
    batch["kept_ids"] = jax.ShapeDtypeStruct((*bt, kept_width), jnp.int32)
  if algorithms.kl_on(rl):
    batch["logp_ref"] = jax.ShapeDtypeStruct(bt, f32)
    batch["kl_coef"] = jax.ShapeDtypeStruct((rows,), f32)
  return batch


def _replicated_params(params, shardings, mesh, min_bytes: int = 1 << 20) -> list:
  if mesh.size == 1:
    return []
  found: dict[str, int] = {}
  for (path, var), (_, sharding) in zip(params.flat_state(), shardings.flat_state()):
    value = var.get_value() if isinstance(var, nnx.Variable) else var
    nbytes = memory.tree_bytes(value)
    if nbytes >= min_bytes and sharding.is_fully_replicated:
      name = "/".join("*" if isinstance(k, int) else str(k) for k in path)
      found[name] = found.get(name, 0) + nbytes
  return sorted(found.items(), key=lambda item: -item[1])


def _critic_bytes(cfg: ModelConfig, optimizer, mesh, rules) -> int:
  """Per-device parameters, AdamW state and gradients (x2) of the critic (a scalar head on the
  policy's trunk, as rl/jobs/trainer.py builds it)."""
  _, params, _ = memory.abstract_model(cfg.replace(head="scalar", tie_embeddings=False))
  shardings = sharding_lib.state_shardings(params, mesh, rules)
  opt_state = jax.eval_shape(optimizer.init, params)
  opt_shardings = sharding_lib.optimizer_shardings(opt_state, params, shardings, mesh)
  return 3 * memory.tree_bytes(params, shardings) + memory.tree_bytes(opt_state, opt_shardings)


def report(config: ml_collections.ConfigDict, *, prompt_len: int | None = None,
           compile_step: bool | None = None, devices: list | None = None,
           compile_rollout: bool = True) -> dict[str, Any]:
  """Sizes of one RL policy update under `config` (see the module docstring).

  `compile_step`: None compiles the update when the mesh fits on the devices; False never
  compiles (analytic estimate only); True requires it. `devices`: what to compile for
  (default: the local devices); e.g. a TPU topology's devices (`aot.topology_devices`) to compile
  ahead of time for a slice this host does not have, with "auto" kernels taken as that
  platform takes them. `compile_rollout`: when the update compiles, the rollout engine compiles
  too (its per-device memory, FLOPs and bytes beside the update's).
  """
  devices = list(jax.devices() if devices is None else devices)
  platform = devices[0].platform
  validate(config)
  cfg = model_config(config)
  plan = None
  if config.mesh.auto:  # the best mesh of models/planner.py for the config's remat / offload
    plan = placement_lib.best_mesh(config, config.mesh.devices or len(devices),
                             planner.device_kind(config.mesh.device_kind))
  mesh, concrete = mesh_for(config, plan.mesh if plan else None, devices)
  if compile_step and not concrete:
    raise ValueError(f"cannot compile: the mesh needs {mesh.size} devices, "
                     f"{len(devices)} given")
  graphdef, params, rest = memory.abstract_model(cfg)
  rules = sharding_lib.make_rules(config.mesh.rules)
  param_shardings = sharding_lib.state_shardings(params, mesh, rules)
  optimizer = ts.make_optimizer(lr=config.optim.lr, warmup_steps=config.optim.warmup_steps,
                                weight_decay=config.optim.weight_decay,
                                grad_clip=config.optim.grad_clip, b1=config.optim.b1,
                                b2=config.optim.b2, master_weights=config.optim.master_weights)
  opt_state = jax.eval_shape(optimizer.init, params)
  opt_shardings = sharding_lib.optimizer_shardings(opt_state, params, param_shardings, mesh)

  total_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
  inactive = 0
  if cfg.is_moe:
    inactive = cfg.n_moe_layers * (cfg.n_experts - cfg.n_experts_per_tok) * 3 * cfg.d_model * (
        cfg.moe_mlp_dim)
  param_bytes = memory.tree_bytes(params, param_shardings)
  replicated = _replicated_params(params, param_shardings, mesh)
  out: dict[str, Any] = {
      "model": describe_model(config),
      "algorithm": describe_rl(config),
      "mesh_shape": dict(mesh.shape),
      "devices": int(mesh.size),
      "local_devices": len(devices),
      "platform": platform,
      "abstract_mesh": not concrete,
      "params_total": total_params,
      "params_active": total_params - inactive,
      "param_dtype": cfg.param_dtype,
      "param_bytes_total": memory.tree_bytes(params),
      "param_bytes_per_device": param_bytes,
      # What sharding_lib.check_not_replicated would reject: (name, bytes) of the parameters
      # of >= 1 MiB left whole on every device (one entry per name, layers merged).
      "replicated_params": replicated,
      "optimizer_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(opt_state) if x.ndim}),
      "optimizer_bytes_per_device": memory.tree_bytes(opt_state, opt_shardings),
      # The accumulated gradients plus one micro-batch's, in the parameters' layout.
      "gradient_bytes_per_device": 2 * param_bytes,
      "reference_bytes_per_device": param_bytes if algorithms.kl_on(config.rl) else 0,
  }
  # An Adam step moves a weight by about lr; below half an ulp of a typical weight (init_std)
  # it rounds away in a 16-bit parameter dtype.
  dtype = jnp.dtype(cfg.param_dtype)
  half_ulp = 0.5 * float(jnp.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(cfg.init_std))
  out["updates_round_away"] = (dtype.itemsize < 4 and config.optim.lr < half_ulp
                               and not config.optim.master_weights)
  critic_bytes = (_critic_bytes(cfg, optimizer, mesh, rules) if algorithms.needs_critic(config.rl)
                  else 0)
  out["critic_bytes_per_device"] = critic_bytes

  if prompt_len is None:
    prompt_len = memory.default_prompt_len(cfg, config.rollout.max_new_tokens)
  length = prompt_len + config.rollout.max_new_tokens
  rows = micro_batch_rows(config)
  batch = batch_spec(config, cfg, rows, length)
  batch_shardings = {
      k: sharding_lib.logical_sharding(("batch", "length", None, None)[:len(v.shape)], v.shape,
                                       mesh) for k, v in batch.items()}
  token_factor = sharding_lib.shard_count(batch_shardings["tokens"].spec, mesh)
  batch_axes = math.prod(dict(mesh.shape)[a] for a in sharding_lib.ROW_AXES)
  tokens_per_device = rows * length / token_factor
  tensor = dict(mesh.shape)["tensor"]
  backend = config.kernel_backend
  if backend == "auto":  # kernels/__init__.py: the reference on CPU, compiled kernels elsewhere
    backend = "reference" if concrete and platform == "cpu" else "compiled"
  per_token = memory.activation_bytes_per_token(cfg, length, tensor=tensor, kernel_backend=backend,
                                                expert=dict(mesh.shape)["expert"])
  host_per_token = memory.offloaded_activation_bytes_per_token(cfg, length, tensor=tensor,
                                                        kernel_backend=backend)
  offload_state = bool(config.optim.offload_state)
  out.update(
      remat=cfg.remat, scan_layers=cfg.scan_layers, planned=plan is not None, offload_optimizer=offload_state,
      host_bytes_per_device=(host_per_token * tokens_per_device
                             + (out["optimizer_bytes_per_device"] if offload_state else 0)),
      sequence_length=length, prompt_len=prompt_len, micro_batch_rows=rows,
      micro_batches=config.train.micro_batches,
      tokens_per_device=tokens_per_device, batch_shards=batch_axes,
      activation_bytes_per_token=per_token,
      activation_bytes_per_device=per_token * tokens_per_device,
      batch_bytes_per_device=memory.tree_bytes(batch, batch_shardings) * config.train.micro_batches,
      kv_cache_bytes_per_sequence=cache_lib.cache_bytes(cfg, 1, length),
      # The model's training FLOPs of one micro-batch (6 x active parameters per token plus
      # attention, models/flops.py), split evenly over the devices.
      model_flops_per_device=(flops_lib.train_flops(cfg, [length] * rows)["total"]
                              / math.prod(dict(mesh.shape).values())),
      max_seq_len=cfg.max_seq_len)
  out["static_bytes_per_device"] = (param_bytes
                                    + (0 if offload_state else out["optimizer_bytes_per_device"])
                                    + out["gradient_bytes_per_device"]
                                    + out["reference_bytes_per_device"] + critic_bytes)
  out["total_bytes_per_device"] = (out["static_bytes_per_device"]
                                   + out["activation_bytes_per_device"]
                                   + out["batch_bytes_per_device"])
  # The rollout engine's call for one step (aot.rollout_shape), its slots and refills as the
  # engine batches them, beside the training state that stays on the devices.
  shape = aot.rollout_shape(config, prompt_len)
  row_shards = sharding_lib.shard_count(sharding_lib.logical_to_spec(("batch",), (mesh.size,), mesh), mesh)
  batching = batching_lib.batching(config.rollout.batch_size, config.rollout.prefill_batch,
                                   shape["sequences"], group_size=shape["group_size"],
                                   row_shards=row_shards)
  rollout = memory.rollout_bytes(
      cfg, sequences=shape["sequences"], slots=batching["slots"],
      prefill_rows=batching["refill_contexts"], prompt_width=shape["prompt_width"],
      new_tokens=shape["new_tokens"], row_shards=row_shards, tensor=tensor,
      expert=dict(mesh.shape)["expert"], kept_ids=placement_lib.workload(config).kept_ids,
      keep_routing=bool(config.rl.keep_routing), kernel_backend=backend)
  out.update(rollout_shape=shape, rollout_batching=batching, rollout_analytic=rollout,
             rollout_total_bytes_per_device=(
                 out["static_bytes_per_device"] - out["gradient_bytes_per_device"]
                 + rollout["total"]))
  out["compiled"] = out["compiled_rollout"] = None
  out["device_spec"] = planner.spec_of(devices[0])
  if concrete and compile_step is not False:
    replicated_sharding = NamedSharding(mesh, PartitionSpec())
    # Buffers outside nnx.Param (e.g. the router's bias) are small and replicated.
    rest_values = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated_sharding), rest)
    leaves, treedef = jax.tree.flatten(params)
    param_values = jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        for x, sh in zip(leaves, jax.tree.leaves(param_shardings), strict=True)])
    state = ts.TrainState(param_values, opt_state, jax.ShapeDtypeStruct((), jnp.int32))
    state_shardings = ts.TrainState(param_shardings, opt_shardings, replicated_sharding)
    out["compiled"] = aot.compile_update(config, mesh, graphdef, state, rest_values,
                                          state_shardings, optimizer, batch, batch_shardings)
    if compile_rollout:
      out["compiled_rollout"] = aot.compile_rollout(
          config, mesh, graphdef, nnx.merge_state(param_values, rest_values),
          out["rollout_shape"])
  return out


def _gib(n: float) -> str:
  return f"{n / GiB:.2f} GiB" if n >= GiB / 100 else f"{n / 2**20:.2f} MiB"


def _count(n: int) -> str:
  return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.3f}M"


def _compiled_lines(label: str, what: str, c: dict[str, float], r: dict[str, Any], *, per: str,
                    trips: int = 0) -> list[str]:
  """The compiler's figures for one program; `trips`: the loop's trip count that turns its
  per-body cost into a roofline bound (0: none printed)."""
  device = r["device_spec"]
  if "overflow" in c:
    return [f"{label:<11} DOES NOT FIT: the {what} needs {_gib(c['temp'])}/device of "
            f"temporaries alone, the compiler has {_gib(c['overflow'])} of HBM (XLA:"
            f"{r['platform']} refused it after {c['compile_seconds']:.1f} s)"]
  fits = ""
  if device is not None:
    fits = (f"; {device.name} holds {_gib(device.hbm_bytes)}: "
            f"{'fits' if c['peak'] <= device.hbm_bytes else 'DOES NOT FIT'}")
  costed = bool(c["flops"] or c["bytes_accessed"])  # XLA:GPU ahead of time gives no cost
  lines = [
      f"{label:<11} {_gib(c['peak'])}/device peak for the {what} (XLA:{r['platform']} "
      f"memory analysis: arguments {_gib(c['argument'])}, outputs {_gib(c['output'])}, "
      f"aliased {_gib(c['alias'])}, temporaries {_gib(c['temp'])}{fits})",
      f"{'':<11} " + (f"{c['flops'] / 1e12:.3g} TFLOP and {c['bytes_accessed'] / 1e9:.3g} GB "
                      f"accessed per device {per} (cost analysis: XLA counts a loop body once)"
                      if costed else f"no cost analysis from XLA:{r['platform']}")
      + f", compiled in {c['compile_seconds']:.1f} s"]
  model = r.get("model_flops_per_device") if trips and costed else None
  if model:
    # The scan over layers is a loop: its body (one layer) counts once in the compiled FLOPs.
    why = ("every layer unrolled: above 1 is remat's recompute and capacity padding"
           if not r.get("scan_layers", True) else "the scan's body counts once: "
           "--config.model.scan_layers=False counts every layer")
    lines.append(f"{'':<11} model {model / 1e12:.3g} TFLOP per device for one micro-batch (6 x "
                 f"active parameters + attention); compiled / model = {c['flops'] / model:.2f} "
                 f"({why})")
  if device is not None and trips and costed:
    cost = dict(c, flops=max(c["flops"], model or 0))
    lines.append(f"{'':<11} roofline ~{trips * aot.roofline_seconds(cost, device):.3g} s per "
                 f"optimiser step on {device.name} ({trips} x the larger FLOPs and the "
                 "compiled bytes; compiled, not run)")
  return lines


def _rollout_line(r: dict[str, Any]) -> str:
  a, b, shape = r["rollout_analytic"], r["rollout_batching"], r["rollout_shape"]
  how = (f"{b['slots']} slots refilled {b['refill_rows']} rows at a time"
         if b["padded"] > b["slots"] else "every sequence at once (static batching)")
  return (f"rollout     ~{_gib(r['rollout_total_bytes_per_device'])}/device (analytic: the state "
          f"above less gradients + KV cache {_gib(a['kv_cache'])} + records "
          f"{_gib(a['records'])} + prefill {_gib(a['prefill'])} + logits {_gib(a['logits'])}; "
          f"{shape['sequences']} sequences, {how}, {b['refill_contexts']} prompt(s) of "
          f"{shape['prompt_width']} tokens per prefill, {shape['new_tokens']} new tokens)")


def format_report(r: dict[str, Any]) -> list[str]:
  """The dry run's printed lines."""
  mesh = " ".join(f"{k}={v}" for k, v in r["mesh_shape"].items())
  where = (f"abstract: {r['local_devices']} {r['platform']} device(s)" if r["abstract_mesh"]
           else f"on {r['platform']} devices")
  lines = [
      f"model {r['model']} | algorithm {r['algorithm']} | mesh {mesh} "
      f"({r['devices']} devices, {where}{'; planned: config.mesh.auto' if r['planned'] else ''})",
      f"parameters: {_count(r['params_total'])} total, {_count(r['params_active'])} active per "
      f"token ({r['param_dtype']})",
      f"params      {_gib(r['param_bytes_per_device'])}/device "
      f"({_gib(r['param_bytes_total'])} in total, sharded "
      f"{r['param_bytes_total'] / r['param_bytes_per_device']:.1f}x)",
      f"optimiser   {_gib(r['optimizer_bytes_per_device'])}/device (AdamW mu + nu in "
      f"{', '.join(r['optimizer_dtypes'])})",
      f"gradients   {_gib(r['gradient_bytes_per_device'])}/device (accumulator + one "
      "micro-batch)",
  ]
  if r["reference_bytes_per_device"]:
    lines.append(f"reference   {_gib(r['reference_bytes_per_device'])}/device (KL: frozen "
                 "copy of the initial policy)")
  if r["critic_bytes_per_device"]:
    lines.append(f"critic      {_gib(r['critic_bytes_per_device'])}/device (params, "
                 "optimiser, gradients)")
  lines += [
      f"activations {_gib(r['activation_bytes_per_device'])}/device (analytic, remat "
      f"{r['remat']}: "
      f"micro-batch of {r['micro_batch_rows']} x {r['sequence_length']} tokens = "
      f"{r['tokens_per_device']:.0f} tokens/device x "
      f"{r['activation_bytes_per_token'] / 2**20:.2f} MiB)",
      f"total       ~{_gib(r['total_bytes_per_device'])}/device for the policy update "
      "(analytic)",
      f"kv cache    {_gib(r['kv_cache_bytes_per_sequence'])} per sequence of "
      f"{r['sequence_length']} tokens",
      _rollout_line(r),
  ]
  if r["host_bytes_per_device"]:
    what = "activations and optimiser state" if r["offload_optimizer"] else "activations"
    lines.append(f"host        {_gib(r['host_bytes_per_device'])}/device in pinned host memory "
                 f"(offloaded {what})")
  if r["remat"] == "none" and r["scan_layers"]:
    lines.append("WARNING: remat none with the layers scanned: the scan stacks every residual "
                 "of its body (Qwen2.5-1.5B's update: 55.91 GiB per v5p chip scanned, 25.67 "
                 "unrolled); set --config.model.scan_layers=False or a remat policy")
  if r["updates_round_away"]:
    lines.append(f"WARNING: parameters are {r['param_dtype']}: Adam steps of ~lr are below half "
                 "an ulp of a typical weight and round away (set config.optim.master_weights=True, "
                 "or param_dtype float32)")
  if r["replicated_params"]:
    names = ", ".join(name for name, _ in r["replicated_params"][:3])
    lines.append(f"WARNING: {len(r['replicated_params'])} parameter name(s) of >= 1 MiB stay whole "
                 f"on every device ({_gib(sum(b for _, b in r['replicated_params']))} in total; "
                 f"{names}, ...): sharding.check_not_replicated rejects this mesh")
  if r["micro_batch_rows"] % r["batch_shards"]:
    lines.append(f"WARNING: a micro-batch of {r['micro_batch_rows']} rows does not divide over "
                 f"the {r['batch_shards']} batch shards (data x fsdp x expert): it is replicated")
  if r["sequence_length"] > r["max_seq_len"]:
    lines.append(f"WARNING: prompt ({r['prompt_len']}) + max_new_tokens = "
                 f"{r['sequence_length']} exceeds the model's max_seq_len {r['max_seq_len']}")
  compiled = r["compiled"]
  if compiled:
    lines += _compiled_lines("compiled", "update", compiled, r,
                             per="for one micro-batch and the optimiser step",
                             trips=r["micro_batches"])
    if "overflow" not in compiled:
      lines.append(f"ratio       analytic / compiled = "
                   f"{r['total_bytes_per_device'] / max(compiled['peak'], 1):.2f}")
    if r["compiled_rollout"]:
      shape = r["rollout_shape"]
      lines += _compiled_lines(
          "rollout", f"rollout engine ({shape['sequences']} sequences: prefill of "
          f"{shape['prompt_width']} tokens, decode of {shape['new_tokens']})",
          r["compiled_rollout"], r, per="for one prefill and one decode step")
  else:
    why = ("the mesh does not fit on the devices (--topology compiles for a TPU slice)"
           if r["abstract_mesh"]
           else "compilation skipped")
    lines.append(f"compiled    not compiled ({why}): the activation figure above is analytic")
  return lines


def verify_plans(config: ml_collections.ConfigDict, plans: list, devices: list,
                 top: int) -> list[dict[str, Any]]:
  """The planner defers to the compiler: the first `top` of `plans` (models/planner.py, ranked
  on analytic estimates) compiled for `devices` (e.g. a TPU topology's) with each plan's mesh,
  remat policy and optimiser placement. Rows: the plan, the compiled update and rollout peaks
  per device, whether both fit the chip's HBM by the compiler, and the planner's estimate over
  the compiler's figure; fitting rows first, then in the planner's order."""
  hbm = planner.spec_of(devices[0]).hbm_bytes
  rows = []
  for i, p in enumerate(plans[:top], 1):
    c = ml_collections.ConfigDict(config.to_dict())
    extra = {k: v for k, v in p.mesh.items() if k not in c.mesh.shape and v != 1}
    if extra:
      raise ValueError(f"plan {i}: mesh axes {extra} have no config.mesh.shape field")
    for axis in c.mesh.shape:
      c.mesh.shape[axis] = p.mesh.get(axis, 1)
    c.mesh.auto = False
    c.model.remat = p.remat
    c.optim.offload_state = p.offload_optimizer
    r = report(c, compile_step=True, devices=devices)
    update, rollout = r["compiled"]["peak"], r["compiled_rollout"]["peak"]
    rows.append(dict(rank=i, plan=p, update=update, rollout=rollout,
                     fits=max(update, rollout) <= hbm,
                     ratio_update=p.memory["update"] / update,
                     ratio_rollout=p.memory["rollout"] / rollout))
  return sorted(rows, key=lambda row: (not row["fits"], row["rank"]))


def format_verified(rows: list[dict[str, Any]], hbm_bytes: float) -> list[str]:
  lines = [f"compiled (per device, GiB; the chip holds {hbm_bytes / GiB:.1f}): planner rank, "
           "mesh data/fsdp/expert/tensor, remat, optimiser, update, rollout, fits, "
           "planner/compiler for update and rollout"]
  for row in rows:
    p, m = row["plan"], row["plan"].mesh
    lines.append(
        f"{row['rank']:>3} {m['data']}/{m['fsdp']}/{m['expert']}/{m['tensor']} {p.remat:<14} "
        f"{'host' if p.offload_optimizer else 'device':<6} {row['update'] / GiB:8.2f} "
        f"{row['rollout'] / GiB:8.2f} {'yes' if row['fits'] else 'NO':<4} "
        f"{row['ratio_update']:6.2f} {row['ratio_rollout']:6.2f}")
  return lines
