"""Sharding planner: which mesh (and rematerialisation / offload choice) a training config
should use on N devices of a given kind, from analytic memory and roofline step-time estimates.

For every factorisation of the device count into the mesh axes data x fsdp x expert x tensor
and every remat policy and optimiser placement asked for, it
estimates per device:

  memory  parameters, AdamW state, gradients (accumulator + one micro-batch), the frozen KL
          reference and the critic, exactly from the parameters' partition specs under the
          logical-axis rules of models/sharding.py; activations of one micro-batch from
          models/memory.py `activation_bytes_per_token` (remat-aware); the batch; and, for the
          rollout that shares the devices, models/memory.py `rollout_bytes` (the slots' KV
          cache, the sequences' records, one refill's prefill) next to the resident
          parameters and optimiser state. A plan fits when the larger of the update's
          and the rollout's peak is within `USABLE_HBM_FRACTION` of the device's HBM.
  time    one RL step's policy updates (all mini-batches and micro-batches) as a roofline:
          FLOPs from models/flops.py (plus the recomputed forward of the remat policy) over
          peak bf16 throughput; HBM traffic (gathered weights read per pass, activations
          written and read, the optimiser's read-modify-write) over HBM bandwidth; FSDP weight
          gathers, gradient reduce-scatters / all-reduces and host copies, which XLA overlaps
          with compute; and the tensor- and expert-parallel collectives, which sit between
          dependent matmuls and are added on top:
            step = max(compute, hbm, fsdp + data + host) + tensor + expert.
          Ring collectives move (n - 1) / n of the data over an axis's bandwidth: the
          interconnect (ICI / NVLink) while the axis stays inside one interconnect domain, the
          data-centre network beyond it.

Plans are ranked: fitting plans first, then by estimated step time, then by memory. The times
are lower bounds (peak rates, perfect overlap); their ratios are what the ranking uses.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Iterable

import jax
import numpy as np
import optax

from models import flops as flops_lib
from models import memory
from models import sharding as sharding_lib
from models.attention import ATTENTION
from models.config import ModelConfig
from models.remat import REMAT_POLICIES

GB = 1e9
# What XLA may use of HBM after its own reservations and fragmentation.
USABLE_HBM_FRACTION = 0.9
# Plans try these remat policies unless told otherwise (offload_* ones on request).
DEFAULT_REMATS = ("none", "dots_no_batch", "names", "full")


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """One accelerator's published rates (bytes and bytes/s; flop/s)."""

  name: str
  hbm_bytes: float
  hbm_bandwidth: float
  peak_bf16_flops: float
  # Per device, one direction, for a ring collective over one mesh axis inside the
  # interconnect domain (ICI torus dimension, NVLink), and across domains (DCN, InfiniBand).
  interconnect_bandwidth: float
  network_bandwidth: float
  devices_per_domain: int
  host_bandwidth: float  # device <-> pinned host memory, one direction


DEVICES: dict[str, DeviceSpec] = {
    # Cloud TPU v5p, https://cloud.google.com/tpu/docs/v5p: 459 bf16 TFLOP/s, 95 GiB HBM2e at
    # 2765 GB/s, 1200 GB/s bidirectional ICI per chip over 6 torus links (100 GB/s per link
    # and direction; a ring over one torus dimension uses its two links: 200 GB/s), 50 Gb/s
    # DCN per chip, 8960 chips in a pod. The host link is not on the spec page: PCIe Gen4 x16
    # (32 GB/s per direction) is an assumption.
    "tpu_v5p": DeviceSpec(
        name="TPU v5p", hbm_bytes=95 * 2**30, hbm_bandwidth=2765e9, peak_bf16_flops=459e12,
        interconnect_bandwidth=200e9, network_bandwidth=50e9 / 8, devices_per_domain=8960,
        host_bandwidth=32e9),
    # Cloud TPU v5e, https://cloud.google.com/tpu/docs/v5e: 197 bf16 TFLOP/s, 16 GB HBM2 at
    # 819 GB/s, 400 GB/s bidirectional ICI per chip over 4 ports of a 2-D torus (a ring over one
    # torus dimension uses two links: 100 GB/s per direction), 256 chips in a pod, 2 x 100 Gb/s
    # NICs per 8-chip host (25 Gb/s per chip). Host link: PCIe Gen4 x16 assumed, as for v5p.
    "tpu_v5e": DeviceSpec(
        name="TPU v5e", hbm_bytes=16 * 2**30, hbm_bandwidth=819e9, peak_bf16_flops=197e12,
        interconnect_bandwidth=100e9, network_bandwidth=25e9 / 8, devices_per_domain=256,
        host_bandwidth=32e9),
    # Cloud TPU v6e (Trillium), https://cloud.google.com/tpu/docs/v6e: 918 bf16 TFLOP/s, 32 GB
    # HBM at 1638 GB/s, 800 GB/s bidirectional ICI per chip over 4 ports of a 2-D torus (200 GB/s
    # per direction for a ring over one dimension), 256 chips in a pod, PCIe Gen5 to the host
    # (64 GB/s per direction). DCN per chip is not on the spec page: v5e's 25 Gb/s is assumed.
    "tpu_v6e": DeviceSpec(
        name="TPU v6e", hbm_bytes=32 * 2**30, hbm_bandwidth=1638e9, peak_bf16_flops=918e12,
        interconnect_bandwidth=200e9, network_bandwidth=25e9 / 8, devices_per_domain=256,
        host_bandwidth=64e9),
    # NVIDIA H100 SXM5, https://www.nvidia.com/en-us/data-center/h100/ (datasheet): 80 GB HBM3
    # at 3.35 TB/s, 989 dense bf16 TFLOP/s (1979 with sparsity), NVLink 900 GB/s bidirectional
    # (450 per direction) inside an 8-GPU HGX / DGX node, PCIe Gen5 x16 128 GB/s bidirectional
    # (64 per direction); across nodes one 400 Gb/s NDR InfiniBand port per GPU (DGX H100
    # datasheet). /work/.library/device/H200.md quotes the same 80 GB, 3.35 TB/s, ~990 TFLOP/s.
    "h100": DeviceSpec(
        name="H100 SXM", hbm_bytes=80e9, hbm_bandwidth=3.35e12, peak_bf16_flops=989e12,
        interconnect_bandwidth=450e9, network_bandwidth=400e9 / 8, devices_per_domain=8,
        host_bandwidth=64e9),
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """The shapes of one RL step's training (launch/dry_run.py sizes the same step)."""

  sequences: int  # per RL step: prompts x samples
  length: int  # prompt + response tokens per sequence
  mini_batches: int
  micro_batches: int
  rollout_length: int  # KV-cache length of a rollout sequence
  rollout_sequences: int  # sequences decoded at once (their KV caches live together)
  prompt_len: int  # the rollout's prompt width (the rest of rollout_length is new tokens)
  prefill_rows: int  # distinct prompts one refill prefills (a prompt's samples share one)
  reference: bool  # a frozen KL reference copy of the policy
  critic: bool  # a value model beside the policy
  kernel_backend: str = "tpu"
  offload_optimizer: bool = False
  kept_ids: int = 0  # int32 kept ids recorded per sampled token (keep-sampling-mask; 0: none)
  keep_routing: bool = False  # the rollout records every token's experts

  @property
  def micro_rows(self) -> int:
    return self.sequences // (self.mini_batches * self.micro_batches)


@dataclasses.dataclass(frozen=True)
class Plan:
  mesh: dict[str, int]
  remat: str
  offload_optimizer: bool
  memory: dict[str, float]  # bytes per device
  time: dict[str, float]  # seconds per RL step
  fits: bool
  notes: tuple[str, ...] = ()

  @property
  def device_bytes(self) -> float:
    return self.memory["peak"]

  @property
  def step_s(self) -> float:
    return self.time["step"]


@dataclasses.dataclass(frozen=True)
class _ParamLeaf:
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  itemsize: int
  count: int  # identical leaves (one per layer)


class _Model:
  """The parameter leaves of a ModelConfig (abstract: nothing is allocated), grouped."""

  def __init__(self, cfg: ModelConfig):
    _, params, _ = memory.abstract_model(cfg)
    groups: dict[tuple, int] = {}
    for _, var in params.flat_state():
      value = var.get_value()
      axes = var.get_metadata().get("logical_axes") or (None,) * len(value.shape)
      key = (tuple(value.shape), tuple(axes), np.dtype(value.dtype).itemsize)
      groups[key] = groups.get(key, 0) + 1
    self.leaves = [_ParamLeaf(*key, count) for key, count in groups.items()]
    self.total_bytes = sum(math.prod(x.shape) * x.itemsize * x.count for x in self.leaves)
    optimizer = _adamw()
    opt_state = jax.eval_shape(optimizer.init, params)
    self.optimizer_ratio = memory.tree_bytes(opt_state) / self.total_bytes

  @functools.lru_cache(maxsize=None)  # noqa: B019 (a few planners per process, each kept)
  def bytes_per_device(self, sizes: tuple[tuple[str, int], ...],
                       rules=sharding_lib.DEFAULT_RULES) -> float:
    """Parameter bytes per device on a mesh of these (axis, size) under the logical-axis
    `rules`."""
    mesh = _shape_only_mesh(dict(sizes))
    total = 0.0
    for leaf in self.leaves:
      spec = sharding_lib.logical_to_spec(leaf.axes, leaf.shape, mesh, rules)
      total += (math.prod(leaf.shape) * leaf.itemsize * leaf.count
                / sharding_lib.shard_count(spec, mesh))
    return total


@functools.lru_cache(maxsize=64)
def _step_flops(cfg: ModelConfig, length: int, sequences: int) -> dict[str, float]:
  return flops_lib.train_flops(cfg, [length] * sequences)


def _adamw():
  """The training optimiser's state layout (rl/core/train_step.make_optimizer: a global-norm clip,
  stateless, then AdamW's mu and nu in the parameters' dtypes)."""
  return optax.adamw(1e-6)


@functools.lru_cache(maxsize=8)
def _model(cfg: ModelConfig) -> _Model:
  return _Model(cfg)


def _shape_only_mesh(sizes: dict[str, int]):
  """What sharding.logical_to_spec reads of a mesh: its axis sizes."""
  return types.SimpleNamespace(shape={a: int(sizes.get(a, 1)) for a in sharding_lib.MESH_AXES})


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(cfg: ModelConfig, devices: int, device: DeviceSpec,
                     max_tensor: int = 16) -> list[dict[str, int]]:
  """Factorisations data x fsdp x expert x tensor of `devices`: expert parallelism only for
  MoE models and dividing the expert count; tensor parallelism dividing the heads (and the
  KV heads of GQA), at most `max_tensor` and inside one interconnect domain."""
  heads = ATTENTION[cfg.attention].tensor_heads(cfg)
  meshes = []
  for tensor in _divisors(devices):
    if tensor > max_tensor or heads % tensor or tensor > device.devices_per_domain:
      continue
    for expert in _divisors(devices // tensor):
      if expert > 1 and (not cfg.is_moe or cfg.n_experts % expert):
        continue
      for fsdp in _divisors(devices // (tensor * expert)):
        data = devices // (tensor * expert * fsdp)
        meshes.append(dict(data=data, fsdp=fsdp, expert=expert, tensor=tensor))
  return meshes


def _axis_bandwidth(mesh: dict[str, int], axis: str, device: DeviceSpec) -> float:
  """A ring over `axis` stays on the interconnect while the axis and every axis inside it
  (MESH_AXES order, innermost last) fit in one domain."""
  inner = math.prod(mesh[a] for a in sharding_lib.MESH_AXES[sharding_lib.MESH_AXES.index(axis):])
  return device.interconnect_bandwidth if inner <= device.devices_per_domain else (
      device.network_bandwidth)


def _ring_s(nbytes: float, n: int, bandwidth: float) -> float:
  """All-gather / reduce-scatter of `nbytes` (the full, gathered size) over a ring of n."""
  return 0.0 if n <= 1 else nbytes * (n - 1) / n / bandwidth


def _remat_flops_factor(remat: str) -> tuple[float, float]:
  """(dense, attention) FLOP multipliers: the forward recomputed in the backward pass is 1/3
  of a training step's FLOPs; `dots_no_batch` recomputes only the attention score matmuls,
  `dots` recomputes none."""
  if remat in ("none", "dots"):
    return 1.0, 1.0
  if remat in ("dots_no_batch", "offload_dots_no_batch"):
    return 1.0, 4.0 / 3.0
  return 4.0 / 3.0, 4.0 / 3.0


def estimate(cfg: ModelConfig, work: Workload, mesh: dict[str, int], device: DeviceSpec,
             remat: str, rules=sharding_lib.DEFAULT_RULES) -> Plan:
  """Memory per device and step time of one plan (see the module docstring); the parameters
  laid out by the logical-axis `rules` (config.mesh.rules). The communication model assumes the
  default rules' layout: FSDP over "embed", tensor parallelism over the heads and MLP."""
  model = _model(cfg)
  sizes = _shape_only_mesh(mesh).shape
  n_devices = math.prod(sizes.values())
  b = np.dtype(cfg.dtype).itemsize
  params = model.bytes_per_device(tuple(sorted(sizes.items())), rules)
  optimizer = model.optimizer_ratio * params
  reference = params if work.reference else 0.0
  critic = (3 + model.optimizer_ratio) * params if work.critic else 0.0
  gradients = 2 * params

  batch_axes = dict(sharding_lib.DEFAULT_RULES)["batch"]
  token_spec = sharding_lib.logical_to_spec(("batch", "length"),
                                            (work.micro_rows, work.length), _shape_only_mesh(sizes))
  batch_shards = sharding_lib.shard_count(token_spec, _shape_only_mesh(sizes))
  notes = []
  # Batch axes that cannot split the micro-batch hold copies of it and repeat its compute.
  redundancy = math.prod(sizes[a] for a in batch_axes) / batch_shards
  if redundancy > 1:
    notes.append(f"micro-batch of {work.micro_rows} rows replicated over some batch axes")
  tokens = work.micro_rows * work.length / batch_shards
  per_token = memory.activation_bytes_per_token(
      cfg, work.length, tensor=sizes["tensor"], kernel_backend=work.kernel_backend, remat=remat,
      expert=sizes["expert"])
  host_per_token = memory.offloaded_activation_bytes_per_token(
      cfg, work.length, tensor=sizes["tensor"], kernel_backend=work.kernel_backend, remat=remat)
  activations = per_token * tokens
  # tokens, masks, log-probs, advantages and the kept ids (launch/dry_run.py batch_spec): 4
  # bytes each, all micro-batches.
  batch = (5 + work.kept_ids) * 4 * tokens * work.micro_batches
  optimizer_device = 0.0 if work.offload_optimizer else optimizer
  update_peak = (params + optimizer_device + gradients + reference + critic + activations
                 + batch)
  rollout = memory.rollout_bytes(
      cfg, sequences=work.sequences, slots=work.rollout_sequences,
      prefill_rows=work.prefill_rows, prompt_width=work.prompt_len,
      new_tokens=work.rollout_length - work.prompt_len,
      row_shards=math.prod(sizes[a] for a in batch_axes), tensor=sizes["tensor"],
      expert=sizes["expert"], kept_ids=work.kept_ids, keep_routing=work.keep_routing,
      kernel_backend=work.kernel_backend)
  rollout_peak = params + optimizer_device + reference + critic + rollout["total"]
  mem = dict(params=params, optimizer=optimizer_device, gradients=gradients,
                reference=reference, critic=critic, activations=activations, batch=batch,
                kv_cache=rollout["kv_cache"], rollout_records=rollout["records"],
                prefill=rollout["prefill"], update=update_peak,
                rollout=rollout_peak,
                peak=max(update_peak, rollout_peak),
                host=host_per_token * tokens + (optimizer if work.offload_optimizer else 0.0))

  # Time of the step's work: mini_batches x micro_batches micro-steps.
  micro_steps = work.mini_batches * work.micro_batches
  flops = _step_flops(cfg, work.length, work.sequences)
  dense_factor, attention_factor = _remat_flops_factor(remat)
  step_flops = flops["dense"] * dense_factor + flops["attention"] * attention_factor
  if work.reference:  # log-probs of the reference model: one forward
    step_flops += flops["total"] / 3
  compute = step_flops * redundancy / n_devices / device.peak_bf16_flops
  passes = 3 if dense_factor > 1 else 2  # weight reads: forward, backward (+ recomputation)
  gathered = params * sizes["fsdp"]
  hbm_bytes = micro_steps * (passes * gathered + 2 * activations) + work.mini_batches * (
      3 * params + 2 * optimizer)
  hbm = hbm_bytes / device.hbm_bandwidth
  fsdp = micro_steps * (passes * _ring_s(gathered, sizes["fsdp"],
                                         _axis_bandwidth(sizes, "fsdp", device))
                        + _ring_s(gathered, sizes["fsdp"],
                                  _axis_bandwidth(sizes, "fsdp", device)))
  data = work.mini_batches * 2 * _ring_s(params, sizes["data"],
                                         _axis_bandwidth(sizes, "data", device))
  host = (micro_steps * 2 * mem["host"] if remat.startswith("offload") else 0.0)
  if work.offload_optimizer:
    host += work.mini_batches * 2 * optimizer
  host /= device.host_bandwidth
  # Tensor parallelism: per layer and pass, all-reduces (= reduce-scatter + all-gather) of
  # the attention and feed-forward outputs [tokens, d_model].
  activation_row = tokens * cfg.d_model * b
  tensor = micro_steps * passes * cfg.n_layers * 2 * 2 * _ring_s(
      activation_row, sizes["tensor"], _axis_bandwidth(sizes, "tensor", device))
  # Expert parallelism: all-to-all of each token's k copies there and back, per MoE layer
  # and pass; (e - 1) / e of them leave the device.
  expert = 0.0
  if cfg.is_moe and sizes["expert"] > 1:
    moved = tokens * cfg.n_experts_per_tok * cfg.d_model * b * (sizes["expert"] - 1) / (
        sizes["expert"])
    expert = (micro_steps * passes * cfg.n_moe_layers * 2 * moved
              / _axis_bandwidth(sizes, "expert", device))
  overlapped = fsdp + data + host
  time = dict(compute=compute, hbm=hbm, fsdp=fsdp, data=data, host=host, tensor=tensor,
              expert=expert, step=max(compute, hbm, overlapped) + tensor + expert)
  fits = mem["peak"] <= USABLE_HBM_FRACTION * device.hbm_bytes
  return Plan(mesh=dict(sizes), remat=remat, offload_optimizer=work.offload_optimizer,
              memory=mem, time=time, fits=fits, notes=tuple(notes))


def rank(plans: Iterable[Plan]) -> list[Plan]:
  """Fitting plans first, fastest first; then the others, closest to fitting first."""
  return sorted(plans, key=lambda p: (0, p.step_s, p.device_bytes) if p.fits
                else (1, p.device_bytes, p.step_s))


def plan(cfg: ModelConfig, work: Workload, devices: int, device: DeviceSpec, *,
         remats: Iterable[str] = DEFAULT_REMATS, offload_optimizer: Iterable[bool] = (False,),
         meshes: list[dict[str, int]] | None = None,
         rules=sharding_lib.DEFAULT_RULES) -> list[Plan]:
  """Every candidate (mesh x remat x optimiser placement), ranked; parameters laid out by the
  logical-axis `rules`."""
  for remat in remats:
    if remat not in REMAT_POLICIES:
      raise ValueError(f"remat {remat!r}: must be one of {REMAT_POLICIES}")
  meshes = meshes if meshes is not None else candidate_meshes(cfg, devices, device)
  if not meshes:
    raise ValueError(f"no mesh of {devices} devices suits this model")
  plans = [estimate(cfg, dataclasses.replace(work, offload_optimizer=offload), mesh, device,
                    remat, rules)
           for mesh in meshes for remat in remats for offload in offload_optimizer]
  return rank(plans)


# jax's `Device.device_kind` (lower case) -> DEVICES key; TPU topologies name v5p "TPU v5".
_KIND_NAMES = {"tpu v5": "tpu_v5p", "tpu v5p": "tpu_v5p", "tpu v5 lite": "tpu_v5e",
               "tpu v5e": "tpu_v5e", "tpu v6 lite": "tpu_v6e", "tpu v6e": "tpu_v6e"}


def spec_of(device) -> DeviceSpec | None:
  """The DEVICES entry of a jax device (a TPU topology's included), or None."""
  kind = device.device_kind.lower()
  if kind in _KIND_NAMES:
    return DEVICES[_KIND_NAMES[kind]]
  return DEVICES["h100"] if "h100" in kind else None


def device_kind(name: str = "") -> DeviceSpec:
  """A DEVICES entry by key, or ("") the one matching the local accelerator."""
  if name:
    if name not in DEVICES:
      raise ValueError(f"device kind {name!r}: must be one of {sorted(DEVICES)}")
    return DEVICES[name]
  spec = spec_of(jax.devices()[0])
  if spec is None:
    raise ValueError(f"no planner numbers for the local device {jax.devices()[0].device_kind!r};"
                     f" name one of {sorted(DEVICES)} (--config.mesh.device_kind)")
  return spec


def _gib(n: float) -> str:
  return f"{n / 2**30:7.1f}"


def format_table(plans: list[Plan], top: int = 15) -> list[str]:
  """The ranking as printed lines: mesh, choices, memory (GiB/device) and time (s/step)."""
  head = (f"{'#':>3} {'data':>4} {'fsdp':>4} {'exp':>4} {'tp':>3} {'remat':<14} {'opt':<6}"
          f" {'params':>7} {'optim':>7} {'grads':>7} {'activ':>7} {'kv':>7} {'peak':>7}"
          f" {'host':>7} {'fits':<4} {'comp_s':>8} {'hbm_s':>8} {'fsdp_s':>8} {'tp_s':>8}"
          f" {'ep_s':>8} {'step_s':>8}")
  lines = [head]
  for i, p in enumerate(plans[:top], 1):
    m, t, mem = p.mesh, p.time, p.memory
    lines.append(
        f"{i:>3} {m['data']:>4} {m['fsdp']:>4} {m['expert']:>4} {m['tensor']:>3} "
        f"{p.remat:<14} {'host' if p.offload_optimizer else 'device':<6}"
        f" {_gib(mem['params'])} {_gib(mem['optimizer'])} {_gib(mem['gradients'])}"
        f" {_gib(mem['activations'])} {_gib(mem['kv_cache'])} {_gib(mem['peak'])}"
        f" {_gib(mem['host'])} {'yes' if p.fits else 'no':<4} {t['compute']:8.2f}"
        f" {t['hbm']:8.2f} {t['fsdp'] + t['data']:8.2f} {t['tensor']:8.2f} {t['expert']:8.2f}"
        f" {t['step']:8.2f}")
  return lines
