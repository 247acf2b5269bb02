"""What the Qwen math RL recipes (qwen2_5_math_dapo.py, vapo_qwen.py, qwen3_moe_dapo.py) share:
the size the argument names, and the math RL settings they start from. Not a config file."""

from __future__ import annotations

import os

import ml_collections

from rl.data import EVAL_DIR

SIZES = {"1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b"}  # argument -> models/config.py preset


def size_of(arg: str, config_file: str) -> str:
  """The model size a Qwen recipe's argument names ("1.5b" when empty)."""
  size = arg or "1.5b"
  if size not in SIZES:
    raise ValueError(f"configs/{config_file}:{arg}: the argument must be one of {sorted(SIZES)}")
  return size


def math_rl(c: ml_collections.ConfigDict, *, hf_dir: str) -> ml_collections.ConfigDict:
  """The math RL settings at DAPO paper scale, scaled to one host's batch: the HF checkpoint,
  prompt files with AIME 2024 held out, temperature-1 sampling of up to 3072 tokens, lr 1e-6
  AdamW (weight decay 0.1, clip 1.0), 128 prompts x 16 samples in 4 optimiser steps.

  The training prompts (DAPO-Math-17k, flattened to `prompt` / `answer` records) are wherever
  the user keeps them: config.data.train_files stays empty and a run without it stops at start
  naming the field (a dry run plans without it)."""
  c.init_hf_dir = hf_dir
  c.tokenizer = hf_dir
  c.data.source = "files"
  c.data.heldout_files = os.path.join(EVAL_DIR, "aime24_test.jsonl")
  c.data.prompt_template = "dapo"
  c.rollout.update(max_new_tokens=3072, temperature=1.0, top_p=1.0, prompt_bucket=128)
  c.rl.clip_low, c.rl.clip_high = 0.2, 0.28
  c.rl.loss_agg_mode = "token-mean"
  c.optim.update(lr=1e-6, warmup_steps=10, weight_decay=0.1, grad_clip=1.0, b1=0.9, b2=0.999)
  c.train.update(steps=500, prompts_per_step=128, samples_per_prompt=16,
                 mini_batches=4,  # 32 prompts (512 sequences) per optimiser step, as in DAPO
                 eval_every=25, checkpoint_every=25)
  return c


def math_rl_on_one_gpu_host(c: ml_collections.ConfigDict, *, size: str,
                            hf_dir: str) -> ml_collections.ConfigDict:
  """`math_rl` on one 8-GPU host. Dense attention keeps [heads, T, T] fp32 probabilities alive
  per layer, so heads (and MLP, vocabulary) are split over GPU groups by tensor parallelism,
  FSDP runs across the groups, and a micro-batch holds one sequence per group."""
  math_rl(c, hf_dir=hf_dir)
  tensor = 2 if size == "1.5b" else 4
  c.mesh.shape.update(data=1, fsdp=8 // tensor, tensor=tensor)
  mini_batch = c.train.prompts_per_step * c.train.samples_per_prompt // c.train.mini_batches
  c.train.micro_batches = mini_batch // (8 // tensor)
  # Continuous batching over 512 decode slots (128 or 256 per batch shard), refilled 128
  # sequences (about 9 prompts, each prefilled once for its 16 samples) at a time: the
  # rollout's KV cache is 7 GiB (1.5B) or 14 GiB (7B) per GPU (the dry run's analytic
  # figure), a quarter of all 2048 sequences' at once.
  c.rollout.update(batch_size=512, prefill_batch=128)
  # 7B recomputes each layer in the backward: without it the update takes 78.37 GiB per H100
  # (XLA:GPU ahead of time, docs/performance.md), over the 80 GB.
  if size == "7b":
    c.model.remat = "full"
  # 1.5B keeps every activation, its layers unrolled, not scanned: without remat a scan stacks
  # every residual of its body, and the update took 55.91 GiB per v5p chip scanned against
  # 25.67 GiB unrolled (libtpu ahead of time on v5p:2x2x2, 2026-11-27, docs/performance.md).
  c.model.scan_layers = c.model.remat != "none"
  return c
