"""Start-up checks of a run config: `validate` (every field, before anything is built) and
`check_paths` (the local files a run reads, at run start).

validate first holds the config to the schema (`check_fields`: the fields of
rl/config/defaults.py base_config, no more and no fewer), so a typo in a config file fails as
one in a --config override does.

validate calls each section's checker where it lives beside the code that reads the section
(data: rl/data/entries.py and rl/data/curriculum.py; rl: rl/core/algorithms.py; mesh:
rl/parallel/placement.py; sampler weights: rl/rollout/fp8.py; streaming: its StreamingConfig;
tools: rl/tool_use/environments.py; model: rl/core/policy.py). The checks below are the
cross-section ones and those of sections whose reader holds none, grouped by the module that
reads the section. Every bad value fails with InputError naming the field and what is allowed.
"""

from __future__ import annotations

import difflib
import os

import ml_collections

import kernels
from rl.core.checks import InputError, allowed, non_negative, positive
from rl.core.policy import check_hf_dir, model_config
from rl.config.defaults import base_config
from rl.config.describe import leaves
from rl.core import algorithms
from rl.core.sampling import kept_ids_width
from rl.data import entries, sources
from rl.parallel import placement
from rl.rewards import rm_graders
from rl.rollout import fp8
from rl.rollout.streaming import StreamingConfig
from rl.tool_use import environments

# launch/jobs.py run_job; the preference jobs' model heads (rl/jobs/preference_jobs.py).
PREFERENCE_HEADS = {"bt_rm": "scalar", "genrm": "lm", "dpo": "lm"}
JOBS = ("rl", "sft", "sft_rl", "o1_coder", *PREFERENCE_HEADS)
TOKENIZERS_BUILTIN = ("byte",)  # models/tokenizer.py load_tokenizer
# config.o1.prm_mode: the PRM objectives of rl/o1_coder/prm.py train_prm (which takes them from
# here: rl.config may not import rl.o1_coder).
PRM_MODES = ("pointwise", "pairwise")


def validate(c: ml_collections.ConfigDict) -> None:
  """Start-up checks: every bad value fails here (InputError), naming the field and what is
  allowed."""
  check_fields(c)
  try:
    _check_run(c)
    model_config(c)
    entries.check_data(c.data)
    _check_rollout(c)
    fp8.check_sampler_weights(c.rollout)
    _check_rl(c)
    _check_reward(c)
    _check_optim(c)
    _check_sft(c)
    _check_preference(c)
    _check_train(c)
    _check_o1(c)
    placement.check_mesh(c.mesh)
    _check_streaming(c)
    check_hf_dir(c)
    environments.check_tools(c.tools, job=c.job)
  except InputError:
    raise
  except ValueError as e:
    raise InputError(str(e)) from None


def check_fields(c: ml_collections.ConfigDict) -> None:
  """Every field of `c` is one of the schema's (base_config(); the model section's fields are
  the same for every preset, the rl section's for every recipe) and none is missing. A
  --config override is held to it by the locked config; this holds the config file to it too:
  an assignment of an unknown field (`c.train.stepz = 3`, made before the file locks its
  config) or a section replaced by a dict of other keys. InputError naming the field and the
  closest field of the schema."""
  schema = leaves(base_config())
  fields = set(leaves(c))
  unknown, missing = sorted(fields - schema.keys()), sorted(schema.keys() - fields)
  if unknown:
    close = difflib.get_close_matches(unknown[0], list(schema), n=1)
    hint = f"; did you mean config.{close[0]}?" if close else ""
    raise InputError(f"config.{unknown[0]}: no such field (the fields are "
                     f"rl/config/defaults.py base_config's){hint}")
  if missing:
    raise InputError(f"config.{missing[0]}: missing (a config sets every field of "
                     "rl/config/defaults.py base_config; was its section replaced?)")


def check_paths(c: ml_collections.ConfigDict) -> None:
  """The local paths a run reads at start exist (InputError naming the field). Not part of
  validate(): a dry run plans a recipe on a machine that does not hold its checkpoint or data."""
  if c.tokenizer not in TOKENIZERS_BUILTIN and not os.path.isdir(c.tokenizer):
    raise InputError(f"config.tokenizer={c.tokenizer!r}: no such directory (use 'byte' or a "
                     "directory holding tokenizer.json)")
  if c.init_hf_dir and not os.path.isfile(os.path.join(c.init_hf_dir, "config.json")):
    raise InputError(f"config.init_hf_dir={c.init_hf_dir!r}: no config.json there (not an HF "
                     "checkpoint directory)")
  if c.data.source == "files":
    for field in ("train_files", "heldout_files"):
      sources.check_files(c.data[field], f"data.{field}")
  if c.job in PREFERENCE_HEADS:
    for field in ("train_files", "heldout_files"):
      if not c.preference[field]:
        raise InputError(f"config.preference.{field} is empty: config.job={c.job!r} reads "
                         "preference pairs from it; set it to jsonl/parquet paths or globs")
      sources.check_files(c.preference[field], f"preference.{field}")
  for field in ("genrm_dir", "bt_dir"):
    if c.reward[field] and not os.path.isfile(os.path.join(c.reward[field], "config.json")):
      raise InputError(f"config.reward.{field}={c.reward[field]!r}: no config.json there (not a "
                       "reward-model job's workdir nor an HF checkpoint directory)")


def _check_run(c: ml_collections.ConfigDict) -> None:
  """The top-level fields (launch/jobs.py, models/tokenizer.py, kernels/)."""
  allowed("job", c.job, JOBS)
  if not c.seed >= 0:  # numpy's generators (data, curriculum) refuse a negative seed
    raise ValueError(f"config.seed={c.seed!r}: must be >= 0")
  if c.init_checkpoint and c.job in ("sft", "sft_rl"):
    raise ValueError(f"config.init_checkpoint={c.init_checkpoint!r} with config.job={c.job!r}: "
                     "SFT starts from config.init_hf_dir or a random init (sft_rl's RL stage "
                     "starts from its SFT checkpoint)")
  if c.tokenizer not in TOKENIZERS_BUILTIN and not c.tokenizer:
    raise ValueError("config.tokenizer: must be 'byte' or a checkpoint directory")
  allowed("kernel_backend", c.kernel_backend, kernels.BACKENDS)


def _check_rollout(c: ml_collections.ConfigDict) -> None:
  """config.rollout (rl/rollout/engine.py run_rollout_config)."""
  positive(c.rollout, "rollout", "max_new_tokens", "prompt_bucket")
  non_negative(c.rollout, "rollout", "temperature", "eval_temperature", "top_k", "batch_size",
               "prefill_batch", "max_kept_ids")
  if c.rollout.max_new_tokens >= c.model.max_seq_len:
    raise ValueError(f"config.rollout.max_new_tokens={c.rollout.max_new_tokens}: must be "
                     f"smaller than config.model.max_seq_len={c.model.max_seq_len} (prompts get "
                     "the rest of the context)")
  if not 0 < c.rollout.top_p <= 1:
    raise ValueError(f"config.rollout.top_p={c.rollout.top_p}: must be in (0, 1]")


def _check_streaming(c: ml_collections.ConfigDict) -> None:
  """config.rollout.streaming: its own StreamingConfig (rl/rollout/streaming.py) checks it."""
  s = c.rollout.streaming
  try:
    StreamingConfig(on_policy_fraction=s.on_policy_fraction, max_staleness=s.max_staleness,
                    round_tokens=s.round_tokens)
  except ValueError as e:
    raise ValueError(str(e).replace("StreamingConfig.", "config.rollout.streaming.")) from None


def _check_rl(c: ml_collections.ConfigDict) -> None:
  """config.rl: rl/core/algorithms.py checks the section; these are its ties to the model and
  the rollout (read by rl/core/losses.py and rl/rewards/shaping.py)."""
  if c.rl.indexer_coef and not model_config(c).dsa:
    raise ValueError(f"config.rl.indexer_coef={c.rl.indexer_coef}: the model has no DSA indexer "
                     "to train (config.model.dsa=False); set it to 0")
  algorithms.validate_rl(c.rl)
  if c.rl.overlong_buffer and c.rl.overlong_buffer >= c.rollout.max_new_tokens:
    raise ValueError(
        f"config.rl.overlong_buffer={c.rl.overlong_buffer}: must be smaller than "
        f"config.rollout.max_new_tokens={c.rollout.max_new_tokens} (the penalty ramps over the "
        "last overlong_buffer tokens; 0 turns it off)")
  non_negative(c.rl, "rl", "kl_coef")
  if c.rl.keep_sampling_mask:
    r = c.rollout
    try:
      kept_ids_width(top_p=r.top_p, top_k=r.top_k, greedy=r.temperature == 0,
                     max_kept=r.max_kept_ids)
    except ValueError:
      raise ValueError(
          f"config.rl.keep_sampling_mask=True with config.rollout.top_p={r.top_p}, "
          f"config.rollout.top_k=0 and config.rollout.max_kept_ids={r.max_kept_ids}: the "
          "rollout records each token's kept set as ids (rl/core/sampling.py), and top-p alone "
          "does not bound it; set config.rollout.max_kept_ids (the nucleus cut to that many "
          "ids, cuts counted) or top_k (kept set = top-p ∩ top-k) or top_p=1") from None


def _check_reward(c: ml_collections.ConfigDict) -> None:
  """config.reward (rl/rewards/rm_graders.py, rl/jobs/reward_models.py, rl/jobs/batch.py)."""
  r = c.reward
  spec = rm_graders.parse_graders(r.graders)
  allowed("reward.hybrid_rm", r.hybrid_rm, rm_graders.HYBRID_RMS)
  if not 0.0 <= r.hybrid_weight <= 1.0:
    raise ValueError(f"config.reward.hybrid_weight={r.hybrid_weight}: must be in [0, 1]")
  for name in sorted(rm_graders.rms_needed(spec, r.hybrid_rm)):
    if not r[f"{name}_dir"]:
      raise ValueError(f"config.reward.graders={r.graders!r} scores with the {name} reward "
                       f"model: set config.reward.{name}_dir")
  non_negative(r, "reward", "length_penalty", "language_reward")
  if r.language_reward and c.tools.enabled:
    raise ValueError("config.reward.language_reward scores single-turn responses: not with "
                     "config.tools.enabled")


def _check_optim(c: ml_collections.ConfigDict) -> None:
  """config.optim (rl/jobs/trainer.py, rl/core/train_step.py)."""
  positive(c.optim, "optim", "lr", "critic_lr", "grad_clip")
  non_negative(c.optim, "optim", "warmup_steps", "weight_decay")
  for f in ("b1", "b2"):
    if not 0 <= c.optim[f] < 1:
      raise ValueError(f"config.optim.{f}={c.optim[f]!r}: must be in [0, 1)")


def _check_sft(c: ml_collections.ConfigDict) -> None:
  """config.sft (rl/jobs/sft.py; carry slips: rl/rewards/puzzles.py with_carry_slips)."""
  positive(c.sft, "sft", "batch_size", "epochs", "lr", "grad_clip", "log_every",
           "checkpoint_every")
  non_negative(c.sft, "sft", "warmup_steps", "weight_decay", "dense_steps", "dense_warmup_steps")
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


def _check_preference(c: ml_collections.ConfigDict) -> None:
  """config.preference (rl/jobs/preference_jobs.py) and the head its job trains."""
  positive(c.preference, "preference", "steps", "beta")
  head = PREFERENCE_HEADS.get(c.job)
  if head and c.model.head != head:
    raise ValueError(f"config.model.head={c.model.head!r} with config.job={c.job!r}: the job "
                     f"trains a model with head={head!r}")


def _check_train(c: ml_collections.ConfigDict) -> None:
  """config.train (rl/jobs/trainer.py)."""
  positive(c.train, "train", "steps", "prompts_per_step", "samples_per_prompt", "mini_batches",
           "micro_batches", "log_every", "checkpoint_every", "keep_checkpoints",
           "max_bad_steps")
  non_negative(c.train, "train", "eval_every")
  batch = c.train.prompts_per_step * c.train.samples_per_prompt
  if batch % (c.train.mini_batches * c.train.micro_batches):
    raise ValueError(
        f"config.train.mini_batches={c.train.mini_batches} x micro_batches="
        f"{c.train.micro_batches} must divide the batch of {batch} sequences "
        f"(prompts_per_step x samples_per_prompt)")


def _check_o1(c: ml_collections.ConfigDict) -> None:
  """config.o1 (rl/o1_coder/selfplay.py run); search_tasks' upper bound, the training tasks left
  after heldout_fraction, is checked there."""
  o = c.o1
  positive(o, "o1", "batch_size", "tcg_cases", "tcg_sft_steps", "tcg_dpo_steps", "tcg_dpo_lr",
           "tests_per_task", "sft_examples", "sft_steps", "dplus_sft_steps", "search_tasks",
           "simulations", "branching", "search_prompt_len", "prm_steps", "eval_samples")
  non_negative(o, "o1", "iterations", "exploration", "max_refines")
  # At least one task and one search tree are always held out: 1 would leave none to train on.
  for f in ("heldout_fraction", "prm_heldout_fraction"):
    if not 0 <= o[f] < 1:
      raise ValueError(f"config.o1.{f}={o[f]!r}: must be in [0, 1)")
  for f in ("distractor_fraction", "compile_weight", "alpha_start", "alpha_end"):
    if not 0 <= o[f] <= 1:
      raise ValueError(f"config.o1.{f}={o[f]!r}: must be in [0, 1]")
  if not 0 < o.process_gamma <= 1:
    raise ValueError(f"config.o1.process_gamma={o.process_gamma!r}: must be in (0, 1]")
  allowed("o1.prm_mode", o.prm_mode, PRM_MODES)
