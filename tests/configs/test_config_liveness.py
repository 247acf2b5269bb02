"""Every field of rl/config/defaults.py base_config() is live: changing it changes what a run does.

Each leaf field (dotted name, e.g. "rl.clip_high", "mesh.shape.data") is claimed by exactly one
of: a probe of this file (PROBES: the field's changed value, the context it matters in and the
observation that must differ) or NOT_COVERED with the reason. `test_every_field_is_claimed_once` fails on a field nobody claims, so a new config field
needs a liveness proof (or a stated reason) before it can land.

The probes observe, from the default and the changed config:
  model    the lowered (not compiled) forward + backward program of the config's model
           (rl/core/policy.py model_config, the path the trainer and SFT build the policy from);
  update   the lowered RL update programs a Trainer builds (policy, critic, router rebalance);
  rollout  the lowered rollout engine of the Trainer's sampling and evaluation settings;
  sft      the lowered SFT steps, batches, checkpoint steps and log lines of rl/sft.run, with
           every jitted function of rl/jobs/sft.py lowered instead of run;
  o1       the calls rl/o1_coder/selfplay.run makes to its stages (each replaced by a recorder)
           and the results it writes;
  and host-side outputs of the code that reads the field (the Trainer's prompts, rewards,
  advantages, batches, generation batches, update loop, run loop, curriculum draws, stream,
  tool set-up, mesh, initial parameters, launcher dispatch).
A field that is read nowhere, or whose change changes nothing, fails its probe.
"""

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging as std_logging
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from rl.config.defaults import base_config
from rl.config.describe import leaves
from rl.core.policy import build_policy, model_config
from rl.config.validation import validate
from rl.core import algorithms
from rl.parallel import placement

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


# ======================================================================== Fields


# A Trainer on the smallest valid run of the base config: 2 prompts x 2 samples of tiny sums.
BASE = {
    "rl.overlong_buffer": 4,  # the dapo recipe's 4096 must be below rollout.max_new_tokens
    "data.task": "addition",
    "data.train_size": 16,
    "data.heldout_size": 8,
    "train.prompts_per_step": 2,
    "train.samples_per_prompt": 2,
    "train.steps": 3,
    "train.eval_every": 0,
    "train.checkpoint_every": 100,
    "mesh.devices": 1,
    "sft.batch_size": 8,
    "sft.epochs": 1,
    "sft.dense_warmup_steps": 1,
    "sft.checkpoint_every": 100,
}

GQA = {"model.attention": "gqa", "model.dsa": False}
YARN = {"model.yarn_factor": 4.0}
# An original context short enough that the rope frequencies fall in all three llama3 bands.
LLAMA3 = {"model.llama3_factor": 8.0, "model.llama3_original_max_len": 64}
# A critic is trained exactly when the estimator reads its values (GAE).
CRITIC = {"rl.estimator": "gae"}
KL = {"rl.kl_coef": 0.1}
FP8 = {"rollout.weight_dtype": "fp8_e4m3"}
STREAM = {"rollout.streaming.enabled": True}
DIFFICULTY = {"data.curriculum": "difficulty", "data.curriculum_window": 1,
              "data.curriculum_threshold": 0.5}
STAGED = {"data.curriculum": "staged", "data.curriculum_stages": "0:addition=1"}
AUTO = {"mesh.auto": True, "mesh.devices": 8}
MESH4 = {"mesh.devices": 4}
TP2 = {**MESH4, "mesh.shape.tensor": 2}
FSDP2 = {**MESH4, "mesh.shape.fsdp": 2}
EP2 = {**MESH4, "mesh.shape.expert": 2}
TOOLS = {"tools.enabled": True, "tools.environments": "trip_planning"}
# A DPO job of 2 steps on the tiny base model, from planted preference files.
PREFERENCE = {"job": "dpo", "preference.train_files": "{prefs}/train.jsonl",
              "preference.heldout_files": "{prefs}/heldout.jsonl", "preference.steps": 2,
              "sft.batch_size": 4}
FILES = {"data.source": "files", "data.train_files": "{files}/train.jsonl",
         "data.heldout_files": "{files}/heldout.jsonl"}
# An O1-Coder run (probe_o1). Self-play refuses a setting it does not read
# (rl/o1_coder/selfplay.py refuse_unread), so BASE's trainer, data, mesh and SFT sizes and the
# dapo recipe's RL features go back to their defaults; 4 search tasks leave training tasks to
# spare for a larger o1.heldout_fraction.
O1_READS = ("train.steps", "train.prompts_per_step", "train.samples_per_prompt")
O1 = {"job": "o1_coder",
      **{k: leaves(base_config())[k] for k in BASE if k not in O1_READS},
      **{f"rl.{k}": v for k, v in algorithms.BASE.items()},
      "o1.search_tasks": 4}

# field: (probe, changed value, context applied to both the default and the changed run).
PROBES = {
    # ---------------------------------------------------------------- model (lowered program)
    "model.vocab_size": ("model", 300, {}),
    "model.d_model": ("model", 96, {}),
    "model.n_layers": ("model", 3, {}),
    "model.n_heads": ("model", 2, {}),
    "model.mlp_dim": ("model", 64, {}),
    "model.attention": ("model", "gqa", {"model.dsa": False}),
    "model.n_kv_heads": ("model", 2, GQA),
    "model.head_dim": ("model", 32, GQA),
    "model.qkv_bias": ("model", True, GQA),
    "model.qk_norm": ("model", True, GQA),
    "model.q_lora_rank": ("model", 16, {}),
    "model.kv_lora_rank": ("model", 16, {}),
    "model.qk_nope_head_dim": ("model", 8, {}),
    "model.qk_rope_head_dim": ("model", 4, {}),
    "model.v_head_dim": ("model", 8, {}),
    "model.dsa": ("model", False, {}),
    "model.index_n_heads": ("model", 1, {}),
    "model.index_head_dim": ("model", 8, {}),
    "model.index_topk": ("model", 4, {}),
    "model.rope_theta": ("model", 500.0, {}),
    "model.rope_interleave": ("model", True, {}),
    "model.yarn_factor": ("model", 4.0, {}),
    "model.yarn_original_max_len": ("model", 64, YARN),
    "model.yarn_beta_fast": ("model", 2.0, YARN),  # moves the ramp's low end (rope dim 8)
    "model.yarn_beta_slow": ("model", 0.05, YARN),  # moves its high end
    "model.yarn_mscale": ("model", 0.5, YARN),
    "model.yarn_mscale_all_dim": ("model", 1.0, YARN),
    "model.llama3_factor": ("model", 8.0, {"model.llama3_original_max_len": 64}),
    "model.llama3_original_max_len": ("model", 64, {"model.llama3_factor": 8.0}),
    "model.llama3_low_freq_factor": ("model", 0.5, LLAMA3),  # moves the blend of the band
    "model.llama3_high_freq_factor": ("model", 2.0, LLAMA3),
    "model.n_experts": ("model", 16, {}),
    "model.n_experts_per_tok": ("model", 3, {}),
    "model.moe_mlp_dim": ("model", 16, {}),
    "model.n_shared_experts": ("model", 0, {}),
    "model.first_k_dense": ("model", 0, {}),
    "model.router": ("model", "softmax", {"model.router_bias_rate": 0.0}),
    "model.norm_topk_prob": ("model", False, {}),
    "model.routed_scaling_factor": ("model", 1.0, {}),
    "model.n_group": ("model", 2, {}),
    "model.topk_group": ("model", 1, {}),
    "model.moe_dispatch": ("model", "dense", {}),
    "optim.master_weights": ("update", True, {"model.param_dtype": "bfloat16"}),
    # The capacity bounds the expert-parallel exchange: an update on an expert mesh.
    "model.moe_capacity_factor": ("update", 1.25, {"mesh.devices": 4, "mesh.shape.expert": 4}),
    "model.rms_norm_eps": ("model", 1e-3, {}),
    "model.tie_embeddings": ("model", True, {}),
    "model.head": ("model", "scalar", {}),
    "model.dtype": ("model", "bfloat16", {}),
    "model.param_dtype": ("model", "bfloat16", {}),
    "model.remat": ("model", "full", {}),
    "model.remat_names": ("model", "attn_in", {"model.remat": "names"}),
    "model.scan_layers": ("model", False, {"model.n_layers": 3}),  # 2 MoE layers
    "kernel_backend": ("model", "interpret", {}),
    # ---------------------------------------------------------------- RL update (lowered)
    "model.router_aux_loss_coef": ("update", 0.0, {}),
    "model.router_bias_rate": ("update", 0.0, {}),
    "rl.clip_low": ("update", 0.1, {}),
    "rl.clip_high": ("update", 0.5, {}),
    "rl.clip_c": ("update", 3.0, {}),
    "rl.loss_agg_mode": ("update", "seq-mean-token-sum", {}),
    "rl.kl_coef": ("update", 0.1, {}),
    "rl.kl_kind": ("update", "k1", KL),
    "rl.entropy_coef": ("update", 0.01, {}),
    "rl.value_clip": ("update", 0.2, CRITIC),
    "rl.nll_coef": ("update", 0.1, {}),
    "rl.offpolicy_mask_delta": ("update", 0.1, {}),
    "rl.indexer_coef": ("update", 1.0, {}),
    "rl.keep_routing": ("update", True, {}),
    # A sampler that does not truncate records no kept set: the mask is a no-op without top-k.
    "rl.keep_sampling_mask": ("update", True, {"rollout.top_k": 5}),
    "optim.lr": ("update", 1e-3, {}),
    "optim.warmup_steps": ("update", 50, {}),
    "optim.weight_decay": ("update", 0.1, {}),
    "optim.grad_clip": ("update", 0.5, {}),
    "optim.b1": ("update", 0.8, {}),
    "optim.b2": ("update", 0.9, {}),
    "optim.critic_lr": ("update", 1e-3, CRITIC),
    "optim.offload_state": ("update", True, {}),
    "train.micro_batches": ("update", 2, {}),
    # ---------------------------------------------------------------- rollout engine (lowered)
    "rollout.max_new_tokens": ("rollout", 8, {}),
    "rollout.temperature": ("rollout", 0.5, {}),
    "rollout.top_p": ("rollout", 0.9, {}),
    "rollout.top_k": ("rollout", 5, {}),
    # The cap of a top-p-alone kept-set record: only with keep-sampling-mask and top_p < 1.
    "rollout.max_kept_ids": ("rollout", 4, {"rl.keep_sampling_mask": True,
                                            "rollout.top_p": 0.9}),
    "rollout.prompt_bucket": ("rollout", 64, {}),
    "rollout.batch_size": ("rollout", 2, {}),
    "rollout.prefill_batch": ("rollout", 2, {"rollout.batch_size": 2}),
    "rollout.eval_temperature": ("rollout", 0.5, {}),
    "rollout.weight_dtype": ("rollout", "fp8_e4m3", {}),
    "rollout.weight_block_size": ("rollout", 16, FP8),
    # ---------------------------------------------------------------- SFT (lowered steps, run)
    "sft.batch_size": ("sft", 4, {}),
    "sft.epochs": ("sft", 2, {}),
    "sft.max_len": ("sft", 48, {}),
    "sft.pack": ("sft", True, {}),
    "sft.lr": ("sft", 1e-2, {}),
    "sft.warmup_steps": ("sft", 1, {"sft.batch_size": 4}),
    "sft.final_lr_fraction": ("sft", 0.5, {}),
    "sft.weight_decay": ("sft", 0.1, {}),
    "sft.grad_clip": ("sft", 0.5, {}),
    "sft.log_every": ("sft", 1, {}),
    "sft.checkpoint_every": ("sft", 1, {"sft.batch_size": 4}),
    "sft.indexer_coef": ("sft", 0.5, {}),
    "sft.dense_warmup_steps": ("sft", 0, {}),
    "sft.dense_steps": ("sft", 1, {}),
    "sft.carry_slip_rate": ("sft", 1.0, {}),
    # ---------------------------------------------------------------- Trainer, host side
    "seed": ("prompts", 1, {}),
    "tokenizer": ("prompts", "{tokenizer}", {}),
    "data.source": ("prompts", "files", {k: v for k, v in FILES.items() if k != "data.source"}),
    "data.train_files": ("prompts", "{files}/train2.jsonl", FILES),
    "data.heldout_files": ("prompts", "{files}/heldout2.jsonl", FILES),
    "data.skip_bad_records": ("prompts", True, {**FILES,
                                                "data.train_files": "{files}/bad.jsonl"}),
    "data.task": ("prompts", "arithmetic", {}),
    "data.difficulty": ("prompts", 1, {}),
    "data.train_size": ("prompts", 12, {}),
    "data.heldout_size": ("prompts", 4, {}),
    "data.heldout_seed": ("prompts", 7, {}),
    "data.train_seed": ("prompts", 5, {}),
    "data.prompt_template": ("prompts", "think", {}),
    "model.max_seq_len": ("prompts", 30, {"rollout.max_new_tokens": 8, **FILES}),
    "rl.reward_mode": ("score", "verify", {}),
    "rl.overlong_buffer": ("score", 2, {}),
    "rl.overlong_factor": ("score", 2.0, {}),
    "rl.kl_coef_per_domain": ("score", "addition=0.5", {}),
    "rl.estimator": ("advantages", "rloo", {}),
    "rl.gamma": ("advantages", 0.5, {"rl.estimator": "reinforce_pp"}),
    "rl.lam": ("advantages", 0.5, CRITIC),
    "rl.lam_critic": ("advantages", 0.5, CRITIC),
    "rl.length_adaptive_alpha": ("advantages", 0.5, CRITIC),
    "reward.graders": ("score", "puzzle=hybrid", {"reward.genrm_dir": "{genrm}"}),
    "reward.genrm_dir": ("score", "{genrm2}", {"reward.graders": "puzzle=genrm",
                                               "reward.genrm_dir": "{genrm}"}),
    "reward.bt_dir": ("score", "{bt2}", {"reward.graders": "puzzle=bt", "reward.bt_dir": "{bt}"}),
    "reward.hybrid_rm": ("score", "bt", {"reward.graders": "puzzle=hybrid",
                                         "reward.genrm_dir": "{genrm}", "reward.bt_dir": "{bt}"}),
    "reward.hybrid_weight": ("score", 0.25, {"reward.graders": "puzzle=hybrid",
                                             "reward.genrm_dir": "{genrm}"}),
    "reward.length_penalty": ("score", 0.5, {}),
    "reward.language_reward": ("score", 0.5, {}),
    "rl.overlong_filter": ("batch", True, {}),
    "rl.dynamic_sampling": ("collect", False, {}),
    "rl.max_num_gen_batches": ("collect", 1, {}),
    "rl.fill_at_cap": ("collect", True, {"rl.max_num_gen_batches": 1}),
    "train.prompts_per_step": ("collect", 1, {}),
    "train.samples_per_prompt": ("collect", 4, {}),
    "rl.ppo_epochs": ("update_loop", 2, {}),
    "train.mini_batches": ("update_loop", 2, {}),
    "rl.critic_warmup_steps": ("update_loop", 5, CRITIC),
    "train.steps": ("run", 2, {}),
    "train.log_every": ("run", 2, {}),
    "train.eval_every": ("run", 1, {}),
    "train.checkpoint_every": ("run", 1, {}),
    "train.keep_checkpoints": ("run", 1, {"train.checkpoint_every": 1}),
    "train.max_bad_steps": ("bad_steps", 2, {}),
    "data.curriculum": ("curriculum", "difficulty", {}),
    "data.curriculum_stages": ("curriculum", "0:math=1;1:code=1", {
        "data.curriculum": "staged", "data.curriculum_stages": "0:math=1", **FILES}),
    "data.curriculum_threshold": ("curriculum", 1.0, DIFFICULTY),
    "data.curriculum_window": ("curriculum", 3, DIFFICULTY),
    "rollout.streaming.enabled": ("stream", True, {}),
    "rollout.streaming.on_policy_fraction": ("stream", 1.0, STREAM),
    "rollout.streaming.max_staleness": ("stream", 2, STREAM),
    "rollout.streaming.round_tokens": ("stream", 4, STREAM),
    "tools.enabled": ("tools", True, {"tools.environments": "trip_planning"}),
    "tools.environments": ("tools", "code_math", {**TOOLS, "tools.allow_weak_sandbox": True}),
    "tools.max_turns": ("tools", 2, TOOLS),
    "tools.max_tool_tokens": ("tools", 128, TOOLS),
    "tools.timeout_s": ("tools", 1.0, TOOLS),
    "tools.workers": ("tools", 2, TOOLS),
    "tools.waves": ("tools", 1, TOOLS),
    "tools.allow_weak_sandbox": ("tools", True, TOOLS),
    "mesh.shape.data": ("mesh", 2, {**MESH4, "mesh.shape.data": 1, "mesh.shape.fsdp": -1}),
    "mesh.shape.fsdp": ("mesh", 2, MESH4),
    "mesh.shape.expert": ("mesh", 2, MESH4),
    "mesh.shape.tensor": ("mesh", 2, MESH4),
    "mesh.dcn.data": ("mesh", 2, {**MESH4, "mesh.shape.data": 1, "mesh.shape.fsdp": -1}),
    "mesh.dcn.fsdp": ("mesh", 2, MESH4),
    "mesh.dcn.expert": ("mesh", 2, MESH4),
    "mesh.dcn.tensor": ("mesh", 2, MESH4),
    "mesh.devices": ("mesh", 2, {}),
    "mesh.auto": ("mesh", True, {"mesh.devices": 8, "mesh.device_kind": "h100"}),
    "mesh.device_kind": ("mesh", "tpu_v5p", {**AUTO, "mesh.device_kind": "h100"}),
    "mesh.rules.vocab": ("param_layout", "", TP2),
    "mesh.rules.embed": ("param_layout", "", FSDP2),
    "mesh.rules.heads": ("param_layout", "", TP2),
    "mesh.rules.kv_heads": ("param_layout", "", {**TP2, **GQA}),
    "mesh.rules.index_heads": ("param_layout", "", TP2),
    "mesh.rules.mlp": ("param_layout", "", TP2),
    "mesh.rules.experts": ("param_layout", "", EP2),
    "mesh.rules.q_lora": ("param_layout", "tensor", TP2),
    "mesh.rules.kv_lora": ("param_layout", "tensor", TP2),
    "mesh.rules.kv": ("param_layout", "fsdp", FSDP2),
    "mesh.rules.norm": ("param_layout", "tensor", TP2),
    "init_checkpoint": ("init", "{init_checkpoint}", {}),
    "init_hf_dir": ("init", "{hf_dir}", {"model.rope_interleave": True}),  # as exported
    "model.init_std": ("init", 0.5, {}),
    "rl.critic_init": ("critic_init", "random", CRITIC),
    "job": ("job", "sft", {}),
    # ------------------------------------------------- preference jobs (rl/jobs/preference_jobs)
    "preference.train_files": ("preference", "{prefs}/train2.jsonl", PREFERENCE),
    "preference.heldout_files": ("preference", "{prefs}/heldout2.jsonl", PREFERENCE),
    "preference.steps": ("preference", 3, PREFERENCE),
    "preference.beta": ("preference", 0.5, PREFERENCE),
    # ------------------------------------------------- O1-Coder (rl/o1_coder/selfplay.py run)
    "o1.heldout_fraction": ("o1", 0.4, O1),
    "o1.batch_size": ("o1", 8, O1),
    "o1.tcg_cases": ("o1", 2, O1),
    "o1.tcg_sft_steps": ("o1", 20, O1),
    "o1.tcg_dpo_steps": ("o1", 5, O1),
    "o1.tcg_dpo_lr": ("o1", 1e-3, O1),
    "o1.tests_per_task": ("o1", 2, O1),
    "o1.sft_examples": ("o1", 100, O1),
    "o1.sft_steps": ("o1", 30, O1),
    "o1.distractor_fraction": ("o1", 0.5, O1),
    "o1.dplus_sft_steps": ("o1", 5, O1),
    "o1.iterations": ("o1", 2, O1),
    "o1.search_tasks": ("o1", 8, O1),
    "o1.simulations": ("o1", 3, O1),
    "o1.exploration": ("o1", 2.0, O1),
    "o1.branching": ("o1", 2, O1),
    "o1.max_refines": ("o1", 2, O1),
    "o1.compile_weight": ("o1", 0.5, O1),
    "o1.search_prompt_len": ("o1", 128, O1),
    "o1.prm_mode": ("o1", "pointwise", O1),
    "o1.prm_steps": ("o1", 10, O1),
    "o1.prm_heldout_fraction": ("o1", 0.5, O1),
    "o1.alpha_start": ("o1", 0.8, O1),
    "o1.alpha_end": ("o1", 1.0, O1),
    "o1.process_gamma": ("o1", 0.5, O1),
    "o1.eval_samples": ("o1", 1, O1),
}

# field: why no test here shows it live.
NOT_COVERED = {
    "rl.policy_loss": "one registered policy loss (ppo_clip, spec section 1), so no other valid "
                      "value; tests/rl/core/test_losses.py shows the update reads it "
                      "(test_the_update_uses_the_policy_loss_the_config_names)",
    "tools.judge_weight": "needs a generative judge checkpoint (tools.judge_hf_dir) loaded and run "
                          "(rl/tool_use/reward.load_judge); too heavy for a liveness probe",
    "tools.judge_hf_dir": "read only when tools.judge_weight > 0 (see there)",
    "tools.warm_start_steps": "runs demonstrations through the tool rollout and SFT steps "
                              "(compiled); too heavy for a liveness probe",
}

def test_every_field_is_claimed_once():
  """Every leaf field of base_config() has exactly one claim (a probe or a stated reason) and
  every claim names a real field: fails when a field is added without a liveness proof, or
  removed while still claimed."""
  fields = list(leaves(base_config()))
  both = sorted(set(PROBES) & set(NOT_COVERED))
  assert not both, f"claimed twice: {both}"
  unclaimed = sorted(set(fields) - set(PROBES) - set(NOT_COVERED))
  assert not unclaimed, f"fields without a liveness probe or a stated reason: {unclaimed}"
  stale = sorted((set(PROBES) | set(NOT_COVERED)) - set(fields))
  assert not stale, f"claims for fields the config does not have: {stale}"


# ======================================================================== Building runs

@pytest.fixture(scope="module")
def resources(tmp_path_factory):
  """Paths the probes' values refer to: prompt files, an HF tokenizer, an orbax policy checkpoint
  and an HF checkpoint of the tiny model (both from another seed)."""
  root = tmp_path_factory.mktemp("liveness")
  files = root / "files"
  files.mkdir()
  long_prompt = "What is 1 + 1? " * 4  # 60 byte tokens: over a 30-token context
  rows = {"train": [("What is 2 + 3?", "5", "math"), ("What is 4 + 4?", "8", "math"),
                    ("print(1 + 1)", "2", "code"), ("print(2 + 2)", "4", "code"),
                    (long_prompt, "2", "math")],
          "heldout": [("What is 1 + 6?", "7", "math"), (long_prompt, "2", "math")],
          "train2": [("What is 9 + 9?", "18", "math"), ("What is 7 + 1?", "8", "math")],
          "heldout2": [("What is 3 + 3?", "6", "math")]}
  rows["bad"] = rows["train"]
  for name, records in rows.items():
    with open(files / f"{name}.jsonl", "w") as f:
      for prompt, answer, domain in records:
        f.write(json.dumps({"prompt": prompt, "answer": answer, "domain": domain}) + "\n")
      if name == "bad":
        f.write("not json\n")
  out = {"files": str(files)}
  from rl.jobs import preference
  prefs = root / "prefs"
  prefs.mkdir()
  for name, n, seed in (("train", 8, 0), ("heldout", 4, 1), ("train2", 8, 2), ("heldout2", 4, 3)):
    preference.save_preferences(prefs / f"{name}.jsonl",
                                preference.make_planted_preferences(n, seed))
  out["prefs"] = str(prefs)

  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(["What is 12 + 34? Answer: 46"] * 20, trainers.BpeTrainer(
      vocab_size=260, special_tokens=["<|endoftext|>"], show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  (root / "tok").mkdir()
  tok.save(str(root / "tok" / "tokenizer.json"))
  with open(root / "tok" / "tokenizer_config.json", "w") as f:
    json.dump({"eos_token": "<|endoftext|>"}, f)
  out["tokenizer"] = str(root / "tok")

  from models import hf
  from rl.jobs.checkpoint import Checkpointer
  c = config_for({"seed": 1}, out)
  policy = build_policy(c)
  _, params, rest = nnx.split(policy, nnx.Param, ...)
  ckpt = Checkpointer(root / "init")
  ckpt.save(0, {"params": params, "rest": rest}, {"step": 0}, force=True)
  ckpt.close()
  out["init_checkpoint"] = str(root / "init")
  hf.save_pretrained(policy, str(root / "hf"), dtype="float32")
  out["hf_dir"] = str(root / "hf")
  # Reward-model job workdirs (config.json + checkpoints/) of two seeds per head.
  from rl.jobs.checkpoint import save_run_config
  for name, head in (("genrm", "lm"), ("bt", "scalar")):
    for seed, suffix in ((2, ""), (3, "2")):
      c = config_for({"seed": seed, "model.head": head}, out)
      _, params, rest = nnx.split(build_policy(c), nnx.Param, ...)
      ckpt = Checkpointer(root / f"{name}{suffix}" / "checkpoints")
      ckpt.save(0, {"params": params, "rest": rest}, {"step": 0}, force=True)
      ckpt.close()
      save_run_config(root / f"{name}{suffix}", c, step=None)
      out[f"{name}{suffix}"] = str(root / f"{name}{suffix}")
  return out


def config_for(overrides: dict, resources: dict | None = None) -> ml_collections.ConfigDict:
  """base_config(algorithm="dapo") with BASE and `overrides` (dotted names; "{name}" in a
  string value is a path of `resources`), validated."""
  c = base_config(algorithm="dapo")
  for key, value in {**BASE, **overrides}.items():
    if isinstance(value, str) and "{" in value:
      value = value.format(**resources)
    section, _, name = key.rpartition(".")
    target = functools.reduce(lambda d, k: d[k], section.split("."), c) if section else c
    if isinstance(value, dict):
      with target.unlocked():
        target[name] = ml_collections.ConfigDict(value)
    else:
      target[name] = value
  validate(c)
  return c


def _text(lowered) -> str:
  return lowered.as_text()


def _digest(*arrays) -> str:
  h = hashlib.sha256()
  for a in arrays:
    h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
  return h.hexdigest()


def _trainer(c, workdir):
  from rl.jobs.trainer import Trainer
  return Trainer(c, str(workdir))


# ======================================================================== Probes

def probe_model(c, workdir, res):
  """Lowered forward + backward of the config's model on 2 x 32 tokens (abstract parameters)."""
  from models.transformer import Transformer
  cfg = model_config(c)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)

  def loss(params, rest, tokens):
    out = nnx.merge(graphdef, params, rest).forward(tokens)
    y = out.logits if cfg.head == "lm" else out.values
    return jnp.sum(y.astype(jnp.float32))

  tokens = jax.ShapeDtypeStruct((2, 32), jnp.int32)
  return _text(jax.jit(jax.grad(loss)).lower(params, rest, tokens))


def update_batch_spec(trainer, rows=4, width=32) -> dict:
  """Abstract mini-batch with the fields Trainer.build_batch gives this config."""
  c = trainer.config
  cfg = model_config(c)
  f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
  batch = {"tokens": jax.ShapeDtypeStruct((rows, width), jnp.int32), "acc": f32(rows)}
  for k in ("response_mask", "attention_mask", "logp_old", "advantages"):
    batch[k] = f32(rows, width)
  if c.rl.keep_routing and cfg.is_moe:
    batch["routing"] = jax.ShapeDtypeStruct(
        (rows, width, cfg.n_moe_layers, cfg.n_experts_per_tok), jnp.int32)
  kept_width = placement.workload(c).kept_ids
  if kept_width:
    batch["kept_ids"] = jax.ShapeDtypeStruct((rows, width, kept_width), jnp.int32)
  if algorithms.kl_on(c.rl):
    batch["logp_ref"], batch["kl_coef"] = f32(rows, width), f32(rows)
  if trainer.critic is not None:
    batch["values"], batch["returns"] = f32(rows, width), f32(rows, width)
  return batch


def probe_update(c, workdir, res):
  """Lowered policy update, critic update and router rebalance of a Trainer."""
  t = _trainer(c, workdir)
  batch = update_batch_spec(t)
  with t.placement.scope():
    texts = [_text(t.policy.update.lower(t.policy.state, t.policy.rest, batch))]
    if t.critic is not None:
      texts.append(_text(t.critic.update.lower(t.critic.state, t.critic.rest, batch)))
    if t.rebalance is not None:
      cfg = model_config(c)
      load = jax.ShapeDtypeStruct((cfg.n_moe_layers, cfg.n_experts), jnp.float32)
      texts.append(_text(t.rebalance.lower(t.policy.state.params, t.policy.rest, load)))
  return texts


def probe_rollout(c, workdir, res):
  """Lowered rollout engine for the Trainer's sampling and held-out evaluation settings, on its
  first two prompts (the state the sampler gets: FP8 codes with weight_dtype)."""
  from rl.rollout import engine, trajectories
  t = _trainer(c, workdir)
  texts = []
  with t.placement.scope():
    state = t._policy_state()
    for cfg in (t.sources.train.cfg, t.sources.heldout.cfg):
      ids, _ = trajectories.prompt_batch(t.task.train_prompts[:2], cfg)
      texts.append(_text(engine.lower_engine(t.policy.graphdef, state, cfg, sequences=4,
                                              prompt_width=ids.shape[1])))
  return texts


def _fake_traj(t, outcomes=None, truncated=None):
  """Trajectories of the Trainer's first prompts whose responses are the gold solution (1) or a
  wrong answer (0), one row per outcome, `samples_per_prompt` rows per group."""
  from scripted_rollout import scripted_trajectories
  g = t.config.train.samples_per_prompt
  outcomes = outcomes if outcomes is not None else [1, 0] * g
  return scripted_trajectories(t, [(n // g, ok, n // g) for n, ok in enumerate(outcomes)],
                               truncated)


def probe_prompts(c, workdir, res):
  """The Trainer's encoded training and held-out prompts (or the error refusing the data)."""
  try:
    t = _trainer(c, workdir)
  except ValueError as e:  # InputError included
    return ["error", str(e)]
  return [t.task.train_prompts, t.task.heldout_prompts]


def probe_score(c, workdir, res):
  """score_trajectories with the Trainer's grader (config.reward's registry) on fixed right /
  wrong responses: scores and per-row KL weights."""
  from rl.jobs.batch import score_trajectories
  t = _trainer(c, workdir)
  traj, entries = _fake_traj(t)
  r = score_trajectories(traj, entries, t.task.grader, c)
  return [r["scores"].tolist(), r["kl_coef"].tolist()]


def probe_advantages(c, workdir, res):
  """Trainer.advantages of fixed scores (critic values fixed to a ramp)."""
  t = _trainer(c, workdir)
  traj, entries = _fake_traj(t)
  t._values = lambda traj: jnp.asarray(traj.response_mask, jnp.float32) * 0.25
  rewards = {"scores": np.array([1.0, -1.0, 0.5, -1.0], np.float32)}
  return {k: np.round(v, 6).tolist() for k, v in t.advantages(traj, rewards).items()}


def probe_batch(c, workdir, res):
  """Trainer.build_batch of a batch whose last row was truncated."""
  t = _trainer(c, workdir)
  traj, entries = _fake_traj(t, truncated=[False, False, False, True])
  advs = {"advantages": np.ones(traj.tokens.shape, np.float32)}
  batch = t.build_batch(traj, {"acc": np.ones(4, np.float32)}, advs)
  return {k: _digest(v) for k, v in batch.items()}


def probe_collect(c, workdir, res):
  """Trainer.collect with a sampler replaced by scripted outcomes (the real verifier scores
  them): which groups are kept, how many generation batches, or the error."""
  from rl.rollout.sources import Rollout
  t = _trainer(c, workdir)
  calls = []

  def rollout(step, batch_index, idx):
    g = c.train.samples_per_prompt
    # First batch: group 0 all right (uniform), the others mixed; later batches all mixed.
    outcomes = [int(n % 2 == 0 or (batch_index == 0 and n < g)) for n in range(len(idx) * g)]
    calls.append(len(idx))
    traj, entries = _fake_traj(t, outcomes)
    return Rollout(traj, entries, {})

  t._rollout = rollout
  try:
    traj, rewards, stats = t.collect(step=0)
  except RuntimeError as e:
    return ["error", str(e), calls]
  return [np.asarray(traj.group_id).tolist(), rewards["acc"].tolist(),
          {k: v for k, v in stats.items() if k in ("gen_batches", "groups_kept",
                                                   "filled_groups")}, calls]


def probe_update_loop(c, workdir, res):
  """Trainer.update with the jitted updates replaced by recorders: rows of every policy and
  critic update call."""
  t = _trainer(c, workdir)
  seen = []

  def record(name):
    def update(state, rest, minibatch):
      seen.append((name, len(minibatch["tokens"])))
      return state, {"skipped": 0.0}
    return update

  t.policy.update = record("policy")
  if t.critic is not None:
    t.critic.update = record("critic")
  t._sampler_logp_gap = lambda batch: {}
  t.placement.put_batch = lambda b: b
  batch = {"tokens": np.zeros((4, 8), np.int32)}
  t.update(0, batch)
  return seen


def probe_run(c, workdir, res, *, skipped=0.0):
  """Trainer._run with every stage replaced by a stand-in and a one-number checkpoint state
  (each update's `skipped` metric as given): metric rows written, held-out evaluations,
  progress log lines and checkpoint steps kept."""
  from rl.jobs import trainer as trainer_lib
  from rl.jobs.checkpoint import PreemptionGuard
  t = _trainer(c, workdir)
  traj, entries = _fake_traj(t)
  rewards = {"scores": np.zeros(4, np.float32), "acc": np.zeros(4, np.float32)}
  stats = {"gen_batches": 1, "groups_seen": 2, "groups_kept": 2, "filled_groups": 0,
           "t_rollout": 0.0, "t_reward": 0.0, "raw_acc": 0.0, "raw_len_mean": 1.0,
           "domain_acc": {}, "curriculum": {}, "source": {}}
  t.collect = lambda step: (traj, rewards, dict(stats))
  t.advantages = lambda traj, rewards: {}
  t.build_batch = lambda traj, rewards, advs: {"response_mask": np.ones((4, 4))}
  t.update = lambda step, batch: {"skipped": skipped}
  evals = []
  t.evaluate = lambda: evals.append(1) or 0.0
  t._checkpoint_state = lambda: {"x": np.zeros(1)}
  logs = []
  info = trainer_lib.logging.info
  trainer_lib.logging.info = lambda *a: logs.append(a[0])
  error = None
  try:
    with PreemptionGuard() as guard:
      t._run(guard)
  except RuntimeError as e:
    error = str(e).split(";")[0]
  finally:
    trainer_lib.logging.info = info
  t.checkpointer.wait() if hasattr(t.checkpointer, "wait") else None
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line)["step"] if "step" in line else 1 for line in f]
  return [len(rows), len(evals), len([m for m in logs if isinstance(m, str) and "step %d/%d" in m]),
          sorted(t.checkpointer.manager.all_steps()), error]


def probe_bad_steps(c, workdir, res):
  """The run loop with every update non-finite: where the run stops."""
  c.train.steps = 5
  return probe_run(c, workdir, res, skipped=1.0)


def probe_curriculum(c, workdir, res):
  """Prompt draws of the Trainer's curriculum over 4 steps at 75% accuracy."""
  from rl.data.templates import prompt_of
  t = _trainer(c, workdir)
  draws = []
  for step in range(4):
    idx = t.task.curriculum.draw(step, 0, 4)
    entries = [t.task.curriculum.entries[i] for i in idx]
    draws.append([prompt_of(e) for e in entries])
    draws.append(t.task.curriculum.observe(step, entries, np.array([1.0, 1.0, 1.0, 0.0])))
  return draws


def probe_stream(c, workdir, res):
  """The Trainer's streaming rollout with a stand-in engine (every row stops after one token):
  the engine's round width, the groups taken from the old pool, and the groups restarted as
  stale two versions later."""
  from rl.rollout import streaming
  from rl.rollout.sources import StreamingSource
  t = _trainer(c, workdir)
  if not isinstance(t.sources.train, StreamingSource):
    return None
  rounds = []

  def engine(graphdef, state, ids, lens, rng, cfg, *, new_tokens, **kw):
    rounds.append(new_tokens)
    n = len(ids)
    tokens = np.concatenate([ids, np.ones((n, new_tokens), np.int32)], 1)
    return {"tokens": tokens, "logp_old": np.zeros(tokens.shape, np.float32),
            "new_count": np.ones(n, np.int32), "stopped": np.ones(n, bool)}

  real = streaming.engine.run_engine, streaming.engine.decode_weights
  streaming.engine.run_engine = engine
  streaming.engine.decode_weights = lambda graphdef, state: (graphdef, state)  # no weights here
  try:
    s = t.sources.train.stream
    s.submit(t.task.train_prompts[:4])
    s.collect(t.policy.graphdef, None, policy_version=0, num_groups=1)
    s.submit(t.task.train_prompts[4:6])
    _, _, stats = s.collect(t.policy.graphdef, None, policy_version=1, num_groups=2)
    return [rounds, stats["old_groups"], s._restart_stale(3)]
  finally:
    streaming.engine.run_engine, streaming.engine.decode_weights = real


def probe_tools(c, workdir, res):
  """The Trainer's tool-use set-up: tasks, encoded prompts, episode rollout settings, tool
  runner."""
  from rl.tool_use.episodes import EpisodeSource
  t = _trainer(c, workdir)
  if not isinstance(t.sources.train, EpisodeSource):
    return [t.task.train_prompts[:4]]
  tools = t.sources.train.episodes
  runner = tools.runner
  out = [t.task.train_prompts[:4], str(tools.rollout.cfg), runner._pool._max_workers,
         runner.timeout_s, runner.allow_weak_sandbox]
  runner.close()
  return out


def probe_mesh(c, workdir, res):
  """The mesh the trainer lays the run out on (rl/placement.Placement.from_config)."""
  from rl.parallel.placement import Placement
  mesh = Placement.from_config(c).mesh
  return [dict(mesh.shape), [d.id for d in mesh.devices.flat]]


def probe_param_layout(c, workdir, res):
  """How the trainer lays the policy's parameters out (Placement.param_shardings): each
  parameter's PartitionSpec."""
  from models import memory
  from rl.core.policy import model_config
  from rl.parallel.placement import Placement
  _, params, _ = memory.abstract_model(model_config(c))
  shardings = Placement.from_config(c).param_shardings(params)
  return sorted((jax.tree_util.keystr(path), str(s.spec))
                for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0])


def probe_init(c, workdir, res):
  """The Trainer's initial policy parameters."""
  t = _trainer(c, workdir)
  return _digest(*jax.tree.leaves(t.policy.state.params))


def probe_critic_init(c, workdir, res):
  """The Trainer's initial critic parameters."""
  t = _trainer(c, workdir)
  return _digest(*jax.tree.leaves(t.critic.state.params))


def probe_job(c, workdir, res):
  """Which stage launch/train.py runs (launch/jobs.py run_job)."""
  import launch.jobs
  import rl.jobs.sft_then_rl
  import rl.o1_coder.selfplay
  import rl.jobs.sft
  import rl.jobs.trainer
  import rl.jobs.preference_jobs
  ran = []
  targets = [(rl.jobs.trainer, "run"), (rl.jobs.sft, "run"), (rl.jobs.sft_then_rl, "run_sft_then_rl"),
             (rl.o1_coder.selfplay, "run"), (rl.jobs.preference_jobs, "run")]
  saved = [getattr(m, n) for m, n in targets]
  try:
    for m, n in targets:
      setattr(m, n, lambda config, workdir, _n=f"{m.__name__}.{n}", **_: ran.append(_n))
    launch.jobs.run_job(c, str(workdir))
  finally:
    for (m, n), fn in zip(targets, saved):
      setattr(m, n, fn)
  return ran


@contextlib.contextmanager
def lowering_jit(record: list):
  """jax.jit for functions of rl/jobs/sft.py and rl/core/train_step.py lowers the call, records the text
  (and a digest of the concrete arguments), and returns zeros of the output shapes instead of
  compiling and running."""
  real = jax.jit

  def jit(fun=None, **kw):
    if fun is None:
      return functools.partial(jit, **kw)
    if getattr(fun, "__module__", "") not in ("rl.jobs.sft", "rl.core.train_step"):
      return real(fun, **kw)
    jitted = real(fun, **kw)
    static = kw.get("static_argnums", ())
    static = (static,) if isinstance(static, int) else tuple(static)
    cache = {}

    def call(*args):
      dyn = [a for i, a in enumerate(args) if i not in static]
      key = (fun.__qualname__, tuple(args[i] for i in static),
             str(jax.tree.map(lambda x: (np.shape(x), str(np.asarray(x).dtype)
                                         if not hasattr(x, "dtype") else str(x.dtype)), dyn)))
      if key not in cache:
        lowered = jitted.lower(*args)
        cache[key] = lowered
        record.append(("program", key[:2], _text(lowered)))
      batch = next((a for a in dyn if isinstance(a, dict) and "tokens" in a), None)
      if batch is not None:
        record.append(("batch", fun.__qualname__, _digest(*jax.tree.leaves(batch))))
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache[key].out_info)
    return call

  jax.jit = jit
  try:
    yield
  finally:
    jax.jit = real


def probe_sft(c, workdir, res):
  """rl/sft.run with its jitted steps lowered, not run: the programs (per DSA stage), batches,
  checkpoint steps and log lines."""
  from rl.jobs import checkpoint, sft
  from rl.jobs.checkpoint import Checkpointer
  record, saved, logs = [], [], []

  class TinyCheckpointer(Checkpointer):
    def save(self, step, state, record, *, force=False):
      done = super().save(step, {"x": np.zeros(1)}, {}, force=force)
      saved.append((step, bool(done)))
      return done

  handler = std_logging.Handler()
  handler.emit = lambda r: logs.append(r.getMessage().split(" loss")[0])
  absl_logger = std_logging.getLogger("absl")
  absl_logger.addHandler(handler)
  level = absl_logger.level
  absl_logger.setLevel(std_logging.INFO)
  real_ckpt = checkpoint.Checkpointer  # what checkpoint.open_stage builds for sft.run
  checkpoint.Checkpointer = TinyCheckpointer
  try:
    with lowering_jit(record):
      sft.run(c, str(workdir))
  finally:
    checkpoint.Checkpointer = real_ckpt
    absl_logger.removeHandler(handler)
    absl_logger.setLevel(level)
  return [record, saved, [m for m in logs if m.startswith("sft step")]]


def probe_preference(c, workdir, res):
  """The metrics of a preference job (rl/jobs/preference_jobs.run): held-out metrics before and
  after training and the last training loss (wall time left out)."""
  from rl.jobs import preference_jobs
  metrics = preference_jobs.run(c, str(workdir))
  return {k: round(v, 6) for k, v in metrics.items() if not k.endswith("wall_s")}


def probe_o1(c, workdir, res):
  """rl/o1_coder/selfplay.run with every model, sandbox and search step replaced by a recorder:
  the arguments each stage is called with (the TCG's and PRM's sizes and steps, a digest of each
  SFT's data, the search sampler's and MCTS settings, every task's test count, each RL step's
  alpha and gamma, the pass-rate samples, the models saved) and the results the run writes,
  wall times left out. Seconds: nothing is built, compiled or run in the sandbox."""
  from types import SimpleNamespace

  from rl.o1_coder import prm as prm_lib, reasoning, selfplay, tcg
  calls = []

  def record(name, result):
    """A stand-in recording its call (numbers and strings as they are, lists by length, other
    objects by type) and returning `result` (or result(*args, **kw))."""
    def recorder(*args, **kw):
      calls.append((name, [a if isinstance(a, (int, float, str)) else
                           len(a) if isinstance(a, (list, tuple)) else type(a).__name__
                           for a in args], kw))
      return result(*args, **kw) if callable(result) else result
    return recorder

  class Policy:  # SelfPlayPolicy: nothing built; records its pass-rate and RL-step calls
    def __init__(self, model, tokenizer, config):
      self.tokenizer = tokenizer
      calls.append(("policy", model))

    def model(self):
      return "policy"

    def pass_rate(self, tasks, grader, **kw):
      calls.append(("pass_rate", len(tasks), kw))
      return 0.5

    def rl_step(self, tasks, grader, prm, *, alpha, gamma, rng):
      calls.append(("rl_step", len(tasks), round(alpha, 6), gamma))
      return {"loss": 0.0}

  def finetune(model, tokenizer, pairs, **kw):
    digest = hashlib.sha256(json.dumps(list(pairs)).encode()).hexdigest()
    calls.append(("finetune", model, digest, kw))
    return "finetuned", {"steps": kw["steps"]}

  def synthesise(tasks, sampler, search_config, *, cases, **kw):
    calls.append(("synthesise", len(tasks), repr(search_config),
                  sorted(len(tests) for tests in cases.values()), kw))
    return [SimpleNamespace(correct_paths=lambda: []) for _ in tasks]

  # A process record per searched task and one correct path (D+), so every stage runs.
  @dataclasses.dataclass(frozen=True)
  class Row:
    sibling_group: tuple

  fake_rm = SimpleNamespace(graphdef=None, params=None, rest=None)
  targets = {
      (selfplay, "_model"): lambda config, *, head, seed: f"{head} model, seed {seed}",
      (selfplay, "save_model"): lambda workdir, name, model, **kw: calls.append(
          ("save_model", name, kw)),
      (selfplay, "supervised_finetune"): finetune,
      (selfplay, "SelfPlayPolicy"): Policy,
      (tcg, "train_tcg"): record("train_tcg", ("tcg", {"dpo/tcg_pass_rate": 0.0})),
      (tcg, "generate_cases"): lambda generator, tokenizer, tasks, **kw: [[] for _ in tasks],
      (reasoning, "PolicySampler"): record("sampler", "sampler"),
      (reasoning, "synthesise"): synthesise,
      (reasoning, "process_dataset"): lambda tasks, trees: [Row((i, 0)) for i in
                                                            range(len(tasks))],
      (reasoning, "correct_paths"): lambda tasks, trees: [(tasks[0], "[plan] p")],
      (prm_lib, "split_by_tree"): record("split_by_tree", lambda rows, *a: (rows, rows)),
      (prm_lib, "train_prm"): record("train_prm", (SimpleNamespace(reward_model=fake_rm),
                                                   {"heldout_pair_accuracy": 0.5})),
  }
  saved = {target: getattr(*target) for target in targets}
  try:
    for (module, name), fn in targets.items():
      setattr(module, name, fn)
    results = selfplay.run(c, str(workdir))
  finally:
    for (module, name), fn in saved.items():
      setattr(module, name, fn)
  results = json.loads(json.dumps(results))
  results.pop("wall_s")
  results["summary"].pop("wall_s")
  return [json.dumps(calls, default=repr), results]


OBSERVE = {name[len("probe_"):]: fn for name, fn in globals().items()
           if name.startswith("probe_")}


@pytest.fixture(scope="module")
def observe(resources, tmp_path_factory):
  """observe(overrides) -> the probe's observation of config_for(overrides); the default-config
  observation of each (probe, context) is computed once."""
  cache = {}

  def run(probe, overrides, cacheable):
    key = (probe, json.dumps(overrides, sort_keys=True))
    if cacheable and key in cache:
      return cache[key]
    c = config_for(overrides, resources)
    workdir = tmp_path_factory.mktemp(probe)
    result = OBSERVE[probe](c, workdir, resources)
    if cacheable:
      cache[key] = result
    return result
  return run


@pytest.mark.parametrize("field,probe,value,context",
                         [pytest.param(f, *PROBES[f], id=f) for f in sorted(PROBES)])
def test_changing_the_field_changes_the_run(field, probe, value, context, observe):
  """Changing config.<field> (in a context where it applies) changes the probe's observation:
  the lowered program, the data, the rewards, the loop's actions. Fails when the field is no
  longer read on that path (or is read but has no effect)."""
  default = observe(probe, context, cacheable=True)
  changed = observe(probe, {**context, field: value}, cacheable=False)
  assert changed != default, f"config.{field}={value!r} changed nothing the {probe} probe sees"
