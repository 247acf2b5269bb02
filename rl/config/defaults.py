"""The run config's sections and their defaults: `base_config(preset=, algorithm=)`.

A recipe (configs/*.py) starts from base_config, changes what it needs, and returns the config
locked: an unknown key (e.g. a typo in `--config.rl.clip_hihg=0.3`) is an error. The bare
defaults are a valid run (a tiny MoE + MLA + DSA policy, GRPO on generated arithmetic); the
comment on each section names the module that reads it, where its checker lives too
(rl/config/validation.py calls them all).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from models import sharding as sharding_lib
from models.config import get_config as get_model_config
from rl.core import algorithms


def model_section(preset: str, **overrides) -> ml_collections.ConfigDict:
  """Every ModelConfig field of the preset (so each is overridable and typos fail) but the
  kernel backend, which is the run's config.kernel_backend. The preset's name is not kept:
  `describe_model` (rl/config/describe.py) names the preset a config matches and the fields
  that differ."""
  fields = dataclasses.asdict(get_model_config(preset, **overrides))
  del fields["kernel_backend"]
  return ml_collections.ConfigDict(fields)


def base_config(*, preset: str = "tiny_moe_mla_dsa", algorithm: str = "grpo",
                **model_overrides) -> ml_collections.ConfigDict:
  """Every section of a run config at its default, the model section from a preset of
  models/config.py (with `model_overrides`) and the rl section from a recipe of
  rl/core/algorithms.py. The defaults validate as they are; "grpo" is the default recipe
  because "dapo"'s overlong buffer (4096 tokens, for 20480-token responses) does not fit the
  default 16-token rollout."""
  c = ml_collections.ConfigDict()
  # "rl", "sft", "sft_rl" (SFT, then RL from it), "o1_coder", or a preference job on
  # config.preference's pairs: "bt_rm" (Bradley-Terry RM), "genrm" (pairwise generative RM),
  # "dpo" (launch/jobs.py).
  c.job = "rl"
  c.seed = 0  # the run's random seed (>= 0)
  # The policy's architecture: every field of models/config.py ModelConfig (rl/core/policy.py).
  c.model = model_section(preset, **model_overrides)
  c.tokenizer = "byte"  # "byte", or a directory holding tokenizer.json (models/tokenizer.py)
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
  # rules: each parameter axis -> the mesh axes it may be sharded over, comma-separated, in
  # order ("" keeps it replicated; MaxText's logical_axis_rules). A dimension takes a mesh axis
  # only when the axis has size > 1, divides it and is not used by another dimension of the
  # same array (models/sharding.py). The trainer, SFT, evaluation, the rollout's weights, HF
  # loading, the planner and the dry run all lay parameters out by them.
  c.mesh = ml_collections.ConfigDict(dict(
      shape=dict(data=-1, fsdp=1, expert=1, tensor=1),
      dcn=dict(data=1, fsdp=1, expert=1, tensor=1),
      auto=False, devices=0, device_kind="",
      rules={name: ",".join(axes) for name, axes in sharding_lib.DEFAULT_RULES
             if name in sharding_lib.PARAM_AXES},
  ))

  # The prompts (rl/data/): generated puzzles or prompt files, and how RL steps draw them.
  c.data = ml_collections.ConfigDict(dict(
      # "puzzles": generated problems of `task`; "files": prompt records (rl/data/sources.py)
      # from `train_files` / `heldout_files` (comma-separated paths or globs, jsonl/parquet),
      # graded by domain (math verifier, code sandbox, puzzle verifiers). No recipe names a
      # machine's files: the user sets them, and check_paths names an empty or missing one.
      source="puzzles",
      train_files="",
      heldout_files="",
      skip_bad_records=False,  # True: malformed rows are skipped and counted, not an error
      task="arithmetic",  # a task of rl/rewards/puzzles.py
      difficulty=0,  # level of the generated task (0: the easiest)
      train_size=2000,  # generated training problems
      heldout_size=200,  # generated held-out problems (evaluation only)
      heldout_seed=10_000,  # a different generator seed: held-out problems never trained on
      # Generator seed of the training problems (puzzles, tool tasks); -1: config.seed. Runs of
      # other seeds from one SFT checkpoint set it to the SFT run's seed, so every run trains
      # and evaluates on the SFT stage's problems (its held-out set stays unseen).
      train_seed=-1,
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
  # Sampling the responses (rl/rollout/engine.py).
  c.rollout = ml_collections.ConfigDict(dict(
      max_new_tokens=16,  # response budget in tokens
      temperature=1.0,  # sampling temperature (0: greedy)
      top_p=1.0,  # nucleus sampling: the smallest set of tokens of this probability (1: off)
      top_k=0,  # sample among the k likeliest tokens (0: off)
      # Keep-sampling-mask with top-p alone (top_k 0): the nucleus is cut to its max_kept_ids
      # most probable ids, the bound of the per-token record (4 bytes an id); the cut tokens
      # are counted (metric kept_cut_tokens). 0 refuses top-p alone with the mask.
      max_kept_ids=64,
      prompt_bucket=16,  # prompt width is rounded up to a multiple of this (fewer compilations)
      eval_temperature=0.0,  # greedy evaluation
      # Decode slots (rl/rollout/engine.py): 0 = every sequence of a generation batch at once
      # (static batching); N = continuous batching over N slots, refilled `prefill_batch`
      # prompts at a time (0: N // 4) as sequences finish. Samples do not depend on it; memory
      # does.
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
  # How responses are scored (rl/rewards/manager.py registry, rl/rewards/rm_graders.py; reward
  # models loaded by rl/jobs/reward_models.py) and shaped (rl/jobs/batch.py).
  c.reward = ml_collections.ConfigDict(dict(
      # Per data domain ("math", "code", "logic", "general", "planted", "puzzle"), comma-separated
      # "domain=grader": "rule" (the verifier), "rule_judge" (math verifier, GenRM judge only
      # where the rules cannot settle), "genrm" (pairwise GenRM P(YES) against the record's
      # reference), "bt" (Bradley-Terry score against it), "hybrid" (rule mixed with an RM).
      # Unnamed domains: "rule" for math, code and puzzles; records of any other domain fail at
      # start.
      graders="",
      # The pairwise GenRM / the Bradley-Terry RM (LM / scalar head): a workdir of ours holding
      # the run config (config.json) and {"params", "rest"} checkpoints, or a local HF checkpoint.
      genrm_dir="",
      bt_dir="",
      hybrid_rm="genrm",  # the reward model of "hybrid": "genrm" or "bt"
      hybrid_weight=0.5,  # hybrid score = (1 - w) * rule + w * RM, w in [0, 1]
      # DeepSeek-V3.2 shaping, added to every row's score: -coef * length / max_new_tokens, and
      # coef * the share of the response's letters in the prompt's script (0: off).
      length_penalty=0.0,
      language_reward=0.0,
  ))
  # The update rule (rl/core: advantages, losses, train_step; rl/core/algorithms.py checks it).
  c.rl = ml_collections.ConfigDict(algorithms.recipe(algorithm))
  # The RL optimiser, policy and critic (rl/jobs/trainer.py).
  c.optim = ml_collections.ConfigDict(dict(
      lr=1e-4,  # the policy's learning rate, constant after the warm-up
      warmup_steps=5,  # steps of linear warm-up from 0
      weight_decay=0.0,  # AdamW weight decay
      grad_clip=1.0,  # global-norm clip of each update's gradient
      b1=0.9,  # AdamW first-moment decay
      b2=0.99,  # AdamW second-moment decay
      critic_lr=2e-4,  # the critic's learning rate (a critic-reading estimator: GAE)
      # Keep the AdamW state in pinned host memory between updates (models/remat.py).
      offload_state=False,
      # AdamW on float32 master weights kept in the optimiser state (train_step.fp32_master):
      # for bf16 parameters, whose own rounding would drop lr-sized steps.
      master_weights=False,
  ))
  # Supervised fine-tuning (rl/jobs/sft.py; the tool warm start reads batch_size, lr, grad_clip).
  c.sft = ml_collections.ConfigDict(dict(
      batch_size=32,  # rows per step (each one example, or several with pack)
      epochs=2,  # passes over the SFT examples
      max_len=0,  # row width in tokens; 0: the longest example. Longer responses are cut.
      pack=False,  # several examples per row (segment ids keep them apart)
      lr=1e-3,  # peak learning rate, after the warm-up
      warmup_steps=20,  # steps of linear warm-up from 0
      final_lr_fraction=0.1,  # cosine decay from lr to lr * this
      weight_decay=0.0,  # AdamW weight decay
      grad_clip=1.0,  # global-norm clip of each step's gradient (also the tool warm start)
      log_every=20,  # optimiser steps between progress lines
      checkpoint_every=200,  # optimiser steps between checkpoints (and one at the end)
      # DSA models: weight of the indexer KL loss (0 leaves the indexer untrained); steps of
      # dense attention training the whole model, the indexer fitted alongside (a stand-in for
      # the trained dense checkpoint DeepSeek-V3.2 starts from: 0 when starting from one); then
      # steps of DeepSeek-V3.2's dense warm-up (everything but the indexer frozen); then sparse.
      indexer_coef=1.0,
      dense_steps=0,
      dense_warmup_steps=200,
      # Generated addition / arithmetic only: the fraction of carrying/borrowing problems whose
      # worked solution forgets every carry, as an imperfect teacher's demonstrations would
      # (rl/rewards/puzzles.with_carry_slips); the verifier still checks the true value.
      carry_slip_rate=0.0,
  ))
  # Preference jobs (rl/jobs/preference_jobs.py): config.job "bt_rm" (needs model.head
  # "scalar"), "genrm" or "dpo" (head "lm") from config.init_checkpoint, config.init_hf_dir or
  # a random init. They train with config.sft's batch_size (pairs per step), lr (constant: no
  # warm-up or decay), weight_decay, grad_clip, log_every and checkpoint_every, and skip bad
  # rows with config.data.skip_bad_records.
  c.preference = ml_collections.ConfigDict(dict(
      # jsonl / parquet files of {"prompt", "chosen", "rejected"[, "reference"]} rows
      # (comma-separated paths or globs): the training pairs and the held-out ones.
      train_files="",
      heldout_files="",
      steps=300,  # optimiser steps
      beta=0.1,  # DPO's beta (config.job "dpo")
  ))
  # The RL loop (rl/jobs/trainer.py).
  c.train = ml_collections.ConfigDict(dict(
      steps=50,  # RL steps
      prompts_per_step=16,  # prompts drawn per step
      samples_per_prompt=8,  # responses sampled per prompt (one group)
      mini_batches=1,  # optimiser steps per PPO epoch
      micro_batches=1,  # gradient-accumulation slices of one mini-batch
      log_every=1,  # steps between progress lines
      eval_every=25,  # steps between held-out evaluations (0: none)
      checkpoint_every=25,  # steps between checkpoints; one is also saved at the end
      keep_checkpoints=2,  # the latest K are kept (>= 1)
      max_bad_steps=3,  # consecutive non-finite steps before the run stops
  ))
  # Multi-turn tool use (rl/tool_use/): RL episodes on tool environments instead of data.source;
  # rollout.max_new_tokens is then the policy-token budget of a whole episode (all turns).
  c.tools = ml_collections.ConfigDict(dict(
      enabled=False,  # True: RL episodes on the environments below instead of config.data
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
  # The O1-Coder pipeline on generated coding tasks (config.job "o1_coder";
  # rl/o1_coder/selfplay.py run): a test-case generator, a bootstrap policy, then `iterations`
  # rounds of MCTS search, a process reward model (PRM) fit and GRPO on the aggregated reward.
  c.o1 = ml_collections.ConfigDict(dict(
      heldout_fraction=0.25,  # fraction of the generated tasks held out (at least one)
      batch_size=16,  # rows of every SFT, DPO and PRM step
      # Test-case generator (TCG, rl/o1_coder/tcg.py).
      tcg_cases=3,  # test cases the TCG writes per task
      tcg_sft_steps=300,  # the TCG's SFT steps
      tcg_dpo_steps=50,  # the TCG's DPO steps on matched vs shuffled-output cases
      # The TCG's DPO learning rate: higher rates push both responses down until no case parses.
      tcg_dpo_lr=1e-4,
      tests_per_task=4,  # trusted cases for tasks without valid TCG cases, and held-out tasks
      # Bootstrap policy (SFT on templated paths), then its O1-Coder initialisation: SFT on the
      # first search's correct paths D+.
      sft_examples=2000,  # templated plan -> refine -> code paths of the bootstrap SFT
      sft_steps=400,  # the bootstrap policy's SFT steps
      distractor_fraction=0.25,  # fraction of those paths consistent but wrong (trees branch)
      dplus_sft_steps=100,  # the policy's SFT steps on D+ (first round)
      # Search (rl/o1_coder/mcts.py, rl/o1_coder/reasoning.py).
      iterations=1,  # rounds of search -> PRM fit -> RL
      search_tasks=50,  # training tasks searched per round (at most the training tasks)
      simulations=15,  # MCTS simulations per task
      exploration=1.0,  # the UCT constant c
      branching=3,  # samples per action when a node is expanded
      max_refines=1,  # refine steps a path may take before its code
      compile_weight=0.2,  # a in the terminal value v = a * compiled + (1 - a) * pass_rate
      search_prompt_len=192,  # the search sampler's fixed prompt width in tokens
      # PRM (rl/o1_coder/prm.py).
      prm_mode="pairwise",  # "pairwise" (sibling steps ranked) or "pointwise" (BCE on values)
      prm_steps=400,  # the PRM's optimiser steps
      prm_heldout_fraction=0.25,  # fraction of the search trees held out (at least one)
      # RL reward phi = alpha(t) R + (1 - alpha(t)) mean_j gamma^j r_j: outcome R and PRM step
      # scores r_j, alpha(t) linear over each round's RL steps.
      alpha_start=1.0,  # alpha at the first RL step (1: the outcome alone)
      alpha_end=0.5,  # alpha at the last RL step
      process_gamma=0.9,  # gamma: the discount of later steps' PRM scores
      eval_samples=2,  # sampled paths per training task for the sampled pass rate
  ))
  return c
