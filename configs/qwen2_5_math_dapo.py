"""DAPO on Qwen2.5-Math-1.5B (or 7B) from a local Hugging Face checkpoint, one 8-GPU host.

  python launch/train.py --config=configs/qwen2_5_math_dapo.py --workdir=/ckpt/dapo_math_1.5b
  python launch/train.py --config=configs/qwen2_5_math_dapo.py:7b \
      --config.init_hf_dir=/models/Qwen2.5-Math-7B --config.tokenizer=/models/Qwen2.5-Math-7B
  python launch/train.py --config=configs/qwen2_5_math_dapo.py --dry_run   # memory per GPU

The DAPO paper's hyper-parameters (spec/rl_algorithms.md sections 6 and 8: lr 1e-6 after 10
warm-up steps, weight decay 0.1, clip 1.0, temperature 1.0, top_p 1.0, clip 0.2 / 0.28,
token-mean loss, dynamic sampling, 16 samples per prompt, 32-prompt mini-batches, overlong
shaping) scaled to one host: 128 prompts per step instead of 512 (4 optimiser steps per rollout
step instead of 16), and Qwen2.5-Math's 4096-token context instead of 2048 + 20480, so responses
stop at 3072 tokens and the overlong buffer shrinks with them (4096 * 3072 / 20480 ~ 512).

Prompt files hold one record per problem with `prompt` (the problem text; the "dapo" template
adds DAPO-Math-17k's instruction) and `answer` (rl/data/sources.py); DAPO-Math-17k's parquet
stores the instruction inside a chat message and the answer in reward_model.ground_truth, so
flatten it to those two fields first. Held-out: AIME 2024 from the pinned eval sets
(rl/data EVAL_DIR: ../shared/data/eval beside the checkout, or $SEEDRL_EVAL_DIR).

Parameters are float32 (bf16 compute): at lr 1e-6 an Adam step is far below half a bfloat16 ulp
of a typical weight, so bfloat16 parameters would not move.
"""

import os

from configs import common
from rl.data import EVAL_DIR

HF_DIRS = {"1.5b": "/models/Qwen2.5-Math-1.5B", "7b": "/models/Qwen2.5-Math-7B"}
PRESETS = {"1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b"}


def get_config(arg: str = "1.5b"):
  size = arg or "1.5b"
  if size not in PRESETS:
    raise ValueError(f"configs/qwen2_5_math_dapo.py:{arg}: the argument must be one of "
                     f"{sorted(PRESETS)}")
  # Qwen2.5-Math shares Qwen2.5's shapes but has a 4096-token context with rope_theta 1e4.
  c = common.base_config(preset=PRESETS[size], algorithm="dapo", rope_theta=10000.0,
                         max_seq_len=4096, param_dtype="float32")
  c.init_hf_dir = HF_DIRS[size]
  c.tokenizer = HF_DIRS[size]

  c.data.source = "files"
  c.data.train_files = "/data/dapo_math_17k.parquet"
  c.data.heldout_files = os.path.join(EVAL_DIR, "aime24_test.jsonl")
  c.data.prompt_template = "dapo"

  c.rollout.max_new_tokens = 3072  # + prompts of up to 1024 tokens = the 4096-token context
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.prompt_bucket = 128

  c.rl.clip_low, c.rl.clip_high = 0.2, 0.28
  c.rl.loss_agg_mode = "token-mean"
  c.rl.overlong_buffer = 512
  c.rl.overlong_factor = 1.0
  c.rl.max_num_gen_batches = 10

  c.optim.lr = 1e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.1
  c.optim.grad_clip = 1.0
  c.optim.b1, c.optim.b2 = 0.9, 0.999

  c.train.steps = 500
  c.train.prompts_per_step = 128
  c.train.samples_per_prompt = 16
  c.train.mini_batches = 4  # 32 prompts (512 sequences) per optimiser step, as in the paper
  c.train.eval_every = 25
  c.train.checkpoint_every = 25
  # Dense attention keeps [heads, T, T] fp32 probabilities alive per layer, so heads (and MLP,
  # vocabulary) are split over GPU groups by tensor parallelism, FSDP runs across the groups,
  # and a micro-batch holds one 4096-token sequence per group.
  tensor = 2 if size == "1.5b" else 4
  c.mesh.shape.update(data=1, fsdp=8 // tensor, tensor=tensor)
  mini_batch = c.train.prompts_per_step * c.train.samples_per_prompt // c.train.mini_batches
  c.train.micro_batches = mini_batch // (8 // tensor)
  return c.lock()
