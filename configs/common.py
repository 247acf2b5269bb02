"""Shared pieces of every config: the section layout, defaults and validation.

A config file's `get_config(arg)` starts from `base_config(...)`, changes what it needs, and
returns a locked ConfigDict: an unknown key (e.g. a typo in `--config.rl.clip_hihg=0.3`) is
an error. `validate(config)` runs at start-up and names the bad field and the allowed values.
"""

from __future__ import annotations

import dataclasses
import math
import os

import ml_collections

from models.config import KERNEL_BACKENDS, ModelConfig, PRESETS, get_config as get_model_config
from rl.core import algorithms

JOBS = ("rl", "sft", "sft_rl", "o1_coder")
TOKENIZERS_BUILTIN = ("byte",)


class InputError(ValueError):
  """Bad input named in the message (a config field, a path, a data record with its file and
  line): the launchers print it as one line and exit with status 2."""


def leaves(c: ml_collections.ConfigDict | dict, prefix: str = "") -> dict:
  """{dotted field name: value} of every leaf of a config ("rl.clip_high", "mesh.shape.data")."""
  out = {}
  for key, value in c.items():
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      out.update(leaves(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def model_section(preset: str, **overrides) -> ml_collections.ConfigDict:
  """Every ModelConfig field of the preset (so each is overridable and typos fail) but the
  kernel backend, which is the run's config.kernel_backend. The preset's name is not kept:
  `describe_model` names the preset a config matches and the fields that differ."""
  fields = dataclasses.asdict(get_model_config(preset, **overrides))
  del fields["kernel_backend"]
  return ml_collections.ConfigDict(fields)


def closest(values: dict, named: dict[str, dict]) -> str:
  """The name in `named` whose fields `values` matches on most, with the fields that differ:
  "dapo" or "dapo (clip_high=0.3, kl_coef=0.01)"."""
  def changes(name):
    return [f"{k}={v!r}" for k, v in values.items() if named[name].get(k) != v]
  name = min(named, key=lambda n: len(changes(n)))
  return name + (f" ({', '.join(changes(name))})" if changes(name) else "")


def describe_model(c: ml_collections.ConfigDict) -> str:
  """config.model as the closest preset and the fields that differ from it."""
  presets = {p: dataclasses.asdict(get_model_config(p)) for p in sorted(PRESETS)}
  return closest(c.model.to_dict(), presets)


def describe_rl(c: ml_collections.ConfigDict) -> str:
  """config.rl as the closest recipe (rl/core/algorithms.py) and the fields that differ from it."""
  return closest(c.rl.to_dict(),
                 {r: algorithms.recipe(r) for r in sorted(algorithms.RECIPES)})


def base_config(*, preset: str = "tiny_moe_mla_dsa", algorithm: str = "dapo",
                **model_overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.job = "rl"
  c.seed = 0
  c.model = model_section(preset, **model_overrides)
  c.tokenizer = "byte"
  c.init_checkpoint = ""  # orbax checkpoint directory of an earlier stage (e.g. SFT)
  # Local Hugging Face checkpoint directory (config.json + safetensors) the policy starts from;
  # "" = random init. Its config.json must describe the same shapes as config.model.
  c.init_hf_dir = ""
  # DSA kernels (kernels/__init__.py): "auto" (by platform), "reference", "interpret", "gpu", "tpu".
  c.kernel_backend = "auto"
  # Device mesh (models/sharding.py, rl/parallel/placement.py): in-slice size of every axis, one of
  # which may be -1 (the devices left over; the default puts them all on "data"), and
  # across-slice (DCN) factors for multi-slice TPU pods or multi-host GPU clusters. The
  # trainer and SFT use the first `devices` local devices (0: all of them) as
  # sharding.mesh_from_config(dict(config.mesh.shape, dcn=config.mesh.dcn)).
  # auto=True: the shape of the best plan of models/planner.py for `devices` (0: the local
  # device count; --dry_run may plan more than there are) devices of `device_kind` ("": the
  # local kind; one of planner.DEVICES), keeping config.model.remat and
  # config.optim.offload_state.
  c.mesh = ml_collections.ConfigDict(dict(
      shape=dict(data=-1, fsdp=1, expert=1, tensor=1),
      dcn=dict(data=1, fsdp=1, expert=1, tensor=1),
      auto=False, devices=0, device_kind="",
  ))

  c.data = ml_collections.ConfigDict(dict(
      # "puzzles": generated problems of `task`; "files": prompt records (rl/data/sources.py)
      # from `train_files` / `heldout_files` (comma-separated paths or globs, jsonl/parquet),
      # graded by domain (math verifier, code sandbox, puzzle verifiers).
      source="puzzles",
      train_files="",
      heldout_files="",
      skip_bad_records=False,  # True: malformed rows are skipped and counted, not an error
      task="arithmetic",  # a task of rl/rewards/puzzles.py
      difficulty=0,
      train_size=2000,
      heldout_size=200,
      heldout_seed=10_000,  # a different generator seed: held-out problems never trained on
      prompt_template="plain",  # a template of rl/data/templates.py ("chat": the chat template)
      # How RL steps draw prompts (rl/data/curriculum.py PromptCurriculum): "" uniform;
      # "difficulty" raises a generated task's level once its accuracy averages >= threshold
      # over `window` steps; "staged" follows curriculum_stages ("0:code=1;200:code=1,math=1");
      # "online" reweights domains by their recent accuracy. Its state is checkpointed.
      curriculum="",
      curriculum_stages="",
      curriculum_threshold=0.8,
      curriculum_window=10,
  ))
  c.rollout = ml_collections.ConfigDict(dict(
      max_new_tokens=16,
      temperature=1.0,
      top_p=1.0,
      top_k=0,
      prompt_bucket=16,
      eval_temperature=0.0,  # greedy evaluation
      # Decode slots (rl/rollout/engine.py): 0 = every sequence of a generation batch at once (static
      # batching); N = continuous batching over N slots, refilled `prefill_batch` prompts at a
      # time (0: N // 4) as sequences finish. Samples do not depend on it; memory does.
      batch_size=0,
      prefill_batch=0,
      # Sampler weights (rl/rollout/fp8.py): "" = the trainer's own; "fp8_e4m3" = the big matmul
      # weights post-training-quantised to FP8 after every update, with one scale per output
      # channel and block of `weight_block_size` inputs (0: the whole input axis).
      weight_dtype="",
      weight_block_size=0,
      # Streaming rollouts (rl/rollout/streaming.py): partial generations carry over between steps
      # (alpha = on_policy_fraction of each batch from the current policy, tokens at most
      # max_staleness versions old, round_tokens per engine round). The pool is not in the
      # checkpoint: a resumed run starts with an empty one.
      streaming=dict(enabled=False, on_policy_fraction=0.5, max_staleness=1, round_tokens=64),
  ))
  c.rl = ml_collections.ConfigDict(algorithms.recipe(algorithm))
  c.optim = ml_collections.ConfigDict(dict(
      lr=1e-4, warmup_steps=5, weight_decay=0.0, grad_clip=1.0, b1=0.9, b2=0.99,
      critic_lr=2e-4,
      # Keep the AdamW state in pinned host memory between updates (models/remat.py).
      offload_state=False,
  ))
  c.sft = ml_collections.ConfigDict(dict(
      batch_size=32,  # rows per step (each one example, or several with pack)
      epochs=2,
      max_len=0,  # row width in tokens; 0: the longest example. Longer responses are cut.
      pack=False,  # several examples per row (segment ids keep them apart)
      lr=1e-3,
      warmup_steps=20,
      final_lr_fraction=0.1,  # cosine decay from lr to lr * this
      weight_decay=0.0,
      grad_clip=1.0,  # global-norm clip of each step's gradient (also the tool warm start)
      log_every=20,
      checkpoint_every=200,  # optimiser steps between checkpoints (and one at the end)
      # DSA models: weight of the indexer KL loss (0 leaves the indexer untrained), and the
      # steps of dense attention (indexer fitted to it) before sparse training.
      indexer_coef=1.0,
      dense_warmup_steps=200,
      # Generated addition / arithmetic only: the fraction of carrying/borrowing problems whose worked
      # solution forgets every carry, as an imperfect teacher's demonstrations would
      # (rl/rewards/puzzles.with_carry_slips); the verifier still checks the true value.
      carry_slip_rate=0.0,
  ))
  c.train = ml_collections.ConfigDict(dict(
      steps=50,
      prompts_per_step=16,
      samples_per_prompt=8,
      mini_batches=1,  # optimiser steps per PPO epoch
      micro_batches=1,  # gradient-accumulation slices of one mini-batch
      log_every=1,
      eval_every=25,
      checkpoint_every=25,  # steps between checkpoints; one is also saved at the end
      keep_checkpoints=2,  # the latest K are kept (>= 1)
      max_bad_steps=3,  # consecutive non-finite steps before the run stops
  ))
  # Multi-turn tool use (rl/tool_use/): RL episodes on tool environments instead of data.source;
  # rollout.max_new_tokens is then the policy-token budget of a whole episode (all turns).
  c.tools = ml_collections.ConfigDict(dict(
      enabled=False,
      environments="",  # comma-separated names of rl/tool_use/environments.py ENVIRONMENTS
      max_turns=4,  # tool calls per episode; one more ends it ("turn_limit")
      max_tool_tokens=96,  # tokens of one tool result, wrapper included (longer ones are cut)
      timeout_s=5.0,  # per tool call
      workers=8,  # thread pool running tool calls
      waves=2,  # episode waves: one wave's tool calls run while another decodes
      allow_weak_sandbox=False,  # python tool without bubblewrap: rlimits only
      judge_weight=0.0,  # reward = (1 - w) * verifier + w * rubric judge P(YES)
      judge_hf_dir="",  # local HF checkpoint of the generative judge (needed when w > 0)
      # > 0: a fresh run first fits the policy to expert transcripts of the training tasks
      # (rl/tool_use/demonstrations.py) for this many steps of config.sft.batch_size rows, lr.
      warm_start_steps=0,
  ))
  return c


def _allowed(field: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f"config.{field}={value!r}: must be one of {list(allowed)}")


def _positive(c: ml_collections.ConfigDict, section: str, *fields: str) -> None:
  for f in fields:
    value = c[section][f]
    if not (value > 0 and math.isfinite(value)):  # NaN compares False: it fails here too
      raise ValueError(f"config.{section}.{f}={value!r}: must be positive and finite")


def _non_negative(c: ml_collections.ConfigDict, section: str, *fields: str) -> None:
  for f in fields:
    value = c[section][f]
    if not (value >= 0 and math.isfinite(value)):
      raise ValueError(f"config.{section}.{f}={value!r}: must be >= 0 and finite")


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig named by config.model (its own checks name the field)."""
  fields = c.model.to_dict()
  if fields.pop("kernel_backend", "auto") != "auto":
    raise ValueError("config.model.kernel_backend is not read: set config.kernel_backend")
  fields["kernel_backend"] = c.get("kernel_backend", "auto")
  _allowed("kernel_backend", fields["kernel_backend"], KERNEL_BACKENDS)
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise ValueError(str(e).replace("ModelConfig.", "config.model.")) from None


def validate(c: ml_collections.ConfigDict) -> None:
  """Start-up checks: every bad value fails here (InputError), naming the field and what is
  allowed."""
  try:
    _validate(c)
  except InputError:
    raise
  except ValueError as e:
    raise InputError(str(e)) from None


def check_paths(c: ml_collections.ConfigDict) -> None:
  """The local paths a run reads at start exist (InputError naming the field). Not part of
  validate(): a dry run plans a recipe on a machine that does not hold its checkpoint."""
  if c.tokenizer not in TOKENIZERS_BUILTIN and not os.path.isdir(c.tokenizer):
    raise InputError(f"config.tokenizer={c.tokenizer!r}: no such directory (use 'byte' or a "
                     "directory holding tokenizer.json)")
  if c.init_hf_dir and not os.path.isfile(os.path.join(c.init_hf_dir, "config.json")):
    raise InputError(f"config.init_hf_dir={c.init_hf_dir!r}: no config.json there (not an HF "
                     "checkpoint directory)")


def _validate(c: ml_collections.ConfigDict) -> None:
  _allowed("job", c.job, JOBS)
  if c.init_checkpoint and c.job in ("sft", "sft_rl"):
    raise ValueError(f"config.init_checkpoint={c.init_checkpoint!r} with config.job={c.job!r}: "
                     "SFT starts from config.init_hf_dir or a random init (sft_rl's RL stage "
                     "starts from its SFT checkpoint)")
  if c.rl.indexer_coef and not model_config(c).dsa:
    raise ValueError(f"config.rl.indexer_coef={c.rl.indexer_coef}: the model has no DSA indexer "
                     "to train (config.model.dsa=False); set it to 0")
  from rl.rewards import puzzles  # deferred: keeps config files importable without rewards
  _allowed("data.source", c.data.source, ("puzzles", "files"))
  _allowed("data.task", c.data.task, sorted(puzzles.TASKS))
  if c.data.source == "files" and not (c.data.train_files and c.data.heldout_files):
    raise ValueError("config.data.source='files' needs config.data.train_files and "
                     "config.data.heldout_files (comma-separated jsonl/parquet paths or globs)")
  from rl.data import templates
  _allowed("data.prompt_template", c.data.prompt_template, templates.TEMPLATES)
  _positive(c, "data", "train_size", "heldout_size")
  _positive(c, "rollout", "max_new_tokens", "prompt_bucket")
  _non_negative(c, "rollout", "temperature", "eval_temperature")
  if c.rollout.max_new_tokens >= c.model.max_seq_len:
    raise ValueError(f"config.rollout.max_new_tokens={c.rollout.max_new_tokens}: must be "
                     f"smaller than config.model.max_seq_len={c.model.max_seq_len} (prompts get "
                     "the rest of the context)")
  if not 0 < c.rollout.top_p <= 1:
    raise ValueError(f"config.rollout.top_p={c.rollout.top_p}: must be in (0, 1]")
  from rl.rollout.fp8 import WEIGHT_DTYPES
  _allowed("rollout.weight_dtype", c.rollout.weight_dtype, WEIGHT_DTYPES)
  if c.rollout.weight_block_size < 0:
    raise ValueError(f"config.rollout.weight_block_size={c.rollout.weight_block_size}: must be "
                     ">= 0 (0: one scale per output channel)")
  algorithms.validate_rl(c.rl)
  if c.rl.overlong_buffer and c.rl.overlong_buffer >= c.rollout.max_new_tokens:
    raise ValueError(
        f"config.rl.overlong_buffer={c.rl.overlong_buffer}: must be smaller than "
        f"config.rollout.max_new_tokens={c.rollout.max_new_tokens} (the penalty ramps over the "
        "last overlong_buffer tokens; 0 turns it off)")
  _non_negative(c, "rl", "kl_coef")
  _positive(c, "optim", "lr", "critic_lr", "grad_clip")
  _non_negative(c, "optim", "warmup_steps", "weight_decay")
  for f in ("b1", "b2"):
    if not 0 <= c.optim[f] < 1:
      raise ValueError(f"config.optim.{f}={c.optim[f]!r}: must be in [0, 1)")
  _positive(c, "sft", "batch_size", "epochs", "lr", "grad_clip", "log_every", "checkpoint_every")
  _non_negative(c, "sft", "warmup_steps", "weight_decay")
  _check_curriculum(c)
  if not 0.0 <= c.sft.carry_slip_rate <= 1.0:
    raise ValueError(f"config.sft.carry_slip_rate={c.sft.carry_slip_rate}: must be in [0, 1]")
  if c.sft.carry_slip_rate and not (c.data.source == "puzzles" and (
      c.data.task == "addition" or (c.data.task == "arithmetic" and c.data.difficulty <= 1))):
    raise ValueError("config.sft.carry_slip_rate > 0 needs two-operand + / - arithmetic: "
                     "config.data.source='puzzles' with task='addition', or task='arithmetic' "
                     "at difficulty 0 or 1")
  if not 0 <= c.sft.max_len <= c.model.max_seq_len:
    raise ValueError(f"config.sft.max_len={c.sft.max_len}: must be in [0, "
                     f"config.model.max_seq_len={c.model.max_seq_len}] (0: the longest example)")
  _positive(c, "train", "steps", "prompts_per_step", "samples_per_prompt", "mini_batches",
            "micro_batches", "log_every", "checkpoint_every", "keep_checkpoints",
            "max_bad_steps")
  _non_negative(c, "train", "eval_every")
  _non_negative(c, "rollout", "batch_size", "prefill_batch")
  batch = c.train.prompts_per_step * c.train.samples_per_prompt
  if batch % (c.train.mini_batches * c.train.micro_batches):
    raise ValueError(
        f"config.train.mini_batches={c.train.mini_batches} x micro_batches="
        f"{c.train.micro_batches} must divide the batch of {batch} sequences "
        f"(prompts_per_step x samples_per_prompt)")
  if c.tokenizer not in TOKENIZERS_BUILTIN and not c.tokenizer:
    raise ValueError("config.tokenizer: must be 'byte' or a checkpoint directory")
  from kernels import BACKENDS
  _allowed("kernel_backend", c.kernel_backend, BACKENDS)
  _check_mesh(c)
  from rl.rollout.streaming import StreamingConfig
  s = c.rollout.streaming
  try:
    StreamingConfig(on_policy_fraction=s.on_policy_fraction, max_staleness=s.max_staleness,
                    round_tokens=s.round_tokens)
  except ValueError as e:
    raise ValueError(str(e).replace("StreamingConfig.", "config.rollout.streaming.")) from None
  _check_hf_dir(c)
  _check_tools(c)


def _check_tools(c: ml_collections.ConfigDict) -> None:
  t = c.tools
  if not t.enabled:
    return
  if c.job != "rl":
    raise ValueError(f"config.tools.enabled=True with config.job={c.job!r}: tool-use episodes "
                     "run in the RL job only (job='rl')")
  from rl.tool_use import environments
  names = [name.strip() for name in t.environments.split(",") if name.strip()]
  if not names:
    raise ValueError("config.tools.environments: name at least one of "
                     f"{sorted(environments.ENVIRONMENTS)} (comma-separated)")
  for name in names:
    _allowed("tools.environments", name, sorted(environments.ENVIRONMENTS))
  _positive(c, "tools", "max_turns", "max_tool_tokens", "timeout_s", "workers", "waves")
  if t.warm_start_steps < 0:
    raise ValueError(f"config.tools.warm_start_steps={t.warm_start_steps}: must be >= 0")
  if not 0.0 <= t.judge_weight <= 1.0:
    raise ValueError(f"config.tools.judge_weight={t.judge_weight}: must be in [0, 1]")
  if t.judge_weight and not t.judge_hf_dir:
    raise ValueError("config.tools.judge_weight > 0 needs config.tools.judge_hf_dir (a local "
                     "HF checkpoint of the generative judge)")


def _check_curriculum(c: ml_collections.ConfigDict) -> None:
  from rl.data import curriculum
  d = c.data
  _allowed("config.data.curriculum", d.curriculum, curriculum.CURRICULA)
  if d.curriculum == "difficulty" and d.source != "puzzles":
    raise ValueError("config.data.curriculum='difficulty' raises the level of generated "
                     "puzzles: it needs config.data.source='puzzles'")
  if d.curriculum == "staged":
    try:
      curriculum.StagedSchedule(curriculum.parse_stages(d.curriculum_stages))
    except ValueError as e:
      raise ValueError(f"config.data.curriculum_stages={d.curriculum_stages!r}: {e}") from None
  if not 0.0 < d.curriculum_threshold <= 1.0:
    raise ValueError(f"config.data.curriculum_threshold={d.curriculum_threshold}: must be in "
                     "(0, 1]")
  if d.curriculum_window < 1:
    raise ValueError(f"config.data.curriculum_window={d.curriculum_window}: must be >= 1")


def _check_mesh(c: ml_collections.ConfigDict) -> None:
  from models.sharding import MESH_AXES
  for table in ("shape", "dcn"):
    sizes = c.mesh[table]
    unknown = sorted(set(sizes) - set(MESH_AXES))
    if unknown:
      raise ValueError(f"config.mesh.{table}: unknown axes {unknown}; allowed: {list(MESH_AXES)}")
    for axis, size in sizes.items():
      if size < 1 and not (table == "shape" and size == -1):
        allowed = "positive or -1 (the devices left over)" if table == "shape" else ">= 1"
        raise ValueError(f"config.mesh.{table}.{axis}={size}: must be {allowed}")
  if list(c.mesh.shape.values()).count(-1) > 1:
    raise ValueError(f"config.mesh.shape={c.mesh.shape.to_dict()}: at most one axis may be -1")
  if c.mesh.devices < 0:
    raise ValueError(f"config.mesh.devices={c.mesh.devices}: must be >= 0 (0: the local "
                     "device count)")
  from models.planner import DEVICES
  if c.mesh.device_kind:
    _allowed("mesh.device_kind", c.mesh.device_kind, sorted(DEVICES))


# Fields a checkpoint's config.json fixes; the rest (dtypes, context length, init, dispatch) a
# config may choose freely.
_HF_FREE_FIELDS = ("dtype", "param_dtype", "init_std", "max_seq_len", "moe_dispatch",
                   "router_aux_loss_coef", "router_bias_rate", "head", "remat", "remat_names",
                   "kernel_backend")


def _check_hf_dir(c: ml_collections.ConfigDict) -> None:
  """When config.init_hf_dir is present on this machine, its shapes must match config.model."""
  if not c.init_hf_dir or not os.path.exists(os.path.join(c.init_hf_dir, "config.json")):
    return
  from models import hf

  def explicit(cfg: ModelConfig) -> dict:  # GQA's 0 = "derived" defaults spelled out
    if cfg.attention == "gqa":
      cfg = cfg.replace(head_dim=cfg.gqa_head_dim, n_kv_heads=cfg.kv_heads)
    return cfg.to_dict()
  theirs = explicit(hf.config_from_hf(hf.read_hf_config(c.init_hf_dir),
                                      source=os.path.join(c.init_hf_dir, "config.json")))
  ours = explicit(model_config(c))
  for field, value in ours.items():
    if field not in _HF_FREE_FIELDS and theirs[field] != value:
      raise ValueError(f"config.model.{field}={value!r} but {c.init_hf_dir}/config.json "
                       f"(config.init_hf_dir) gives {theirs[field]!r}")


def build_policy(c: ml_collections.ConfigDict, mesh=None):
  """The policy of a run: loaded from config.init_hf_dir (its shapes were checked against
  config.model by validate; with `mesh`, each tensor goes straight into its shards) or
  freshly initialised from config.model (built whole on the default device: big models
  start from a checkpoint)."""
  from flax import nnx

  from models.transformer import Transformer
  cfg = model_config(c)
  if c.init_hf_dir:
    from models import hf
    return hf.load_pretrained(c.init_hf_dir, mesh=mesh,
                              **{f: getattr(cfg, f) for f in _HF_FREE_FIELDS})
  return Transformer(cfg, rngs=nnx.Rngs(params=c.seed))


QWEN_SIZES = {"1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b"}


def qwen_size(arg: str, config_file: str) -> str:
  """The model size a Qwen recipe's argument names ("1.5b" when empty)."""
  size = arg or "1.5b"
  if size not in QWEN_SIZES:
    raise ValueError(f"configs/{config_file}:{arg}: the argument must be one of "
                     f"{sorted(QWEN_SIZES)}")
  return size


def math_rl_on_one_gpu_host(c: ml_collections.ConfigDict, *, size: str,
                            hf_dir: str) -> ml_collections.ConfigDict:
  """Shared settings of the math RL recipes on one 8-GPU host (DAPO paper scale, scaled to
  one host): the HF checkpoint, DAPO-Math prompts with AIME 2024 held out, temperature-1
  sampling of up to 3072 tokens, lr 1e-6 AdamW (weight decay 0.1, clip 1.0), 128 prompts x
  16 samples in 4 optimiser steps.

  Dense attention keeps [heads, T, T] fp32 probabilities alive per layer, so heads (and MLP,
  vocabulary) are split over GPU groups by tensor parallelism, FSDP runs across the groups,
  and a micro-batch holds one sequence per group.
  """
  from rl.data import EVAL_DIR
  c.init_hf_dir = hf_dir
  c.tokenizer = hf_dir
  c.data.source = "files"
  c.data.train_files = "/data/dapo_math_17k.parquet"
  c.data.heldout_files = os.path.join(EVAL_DIR, "aime24_test.jsonl")
  c.data.prompt_template = "dapo"
  c.rollout.update(max_new_tokens=3072, temperature=1.0, top_p=1.0, prompt_bucket=128)
  c.rl.clip_low, c.rl.clip_high = 0.2, 0.28
  c.rl.loss_agg_mode = "token-mean"
  c.optim.update(lr=1e-6, warmup_steps=10, weight_decay=0.1, grad_clip=1.0, b1=0.9, b2=0.999)
  c.train.update(steps=500, prompts_per_step=128, samples_per_prompt=16,
                 mini_batches=4,  # 32 prompts (512 sequences) per optimiser step, as in DAPO
                 eval_every=25, checkpoint_every=25)
  tensor = 2 if size == "1.5b" else 4
  c.mesh.shape.update(data=1, fsdp=8 // tensor, tensor=tensor)
  mini_batch = c.train.prompts_per_step * c.train.samples_per_prompt // c.train.mini_batches
  c.train.micro_batches = mini_batch // (8 // tensor)
  return c

