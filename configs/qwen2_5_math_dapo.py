"""DAPO on Qwen2.5-Math-1.5B (or 7B) from a local Hugging Face checkpoint, one 8-GPU host.

  python launch/train.py --config=configs/qwen2_5_math_dapo.py --workdir=/ckpt/dapo_math_1.5b \
      --config.data.train_files=/data/dapo_math_17k.parquet
  python launch/train.py --config=configs/qwen2_5_math_dapo.py:7b \
      --config.data.train_files=/data/dapo_math_17k.parquet \
      --config.init_hf_dir=/models/Qwen2.5-Math-7B --config.tokenizer=/models/Qwen2.5-Math-7B
  python launch/train.py --config=configs/qwen2_5_math_dapo.py --dry_run   # memory per GPU

The DAPO paper's hyper-parameters (docs/rl_algorithms.md sections 6 and 8: lr 1e-6 after 10
warm-up steps, weight decay 0.1, clip 1.0, temperature 1.0, top_p 1.0, clip 0.2 / 0.28,
token-mean loss, dynamic sampling, 16 samples per prompt, 32-prompt mini-batches, overlong
shaping) scaled to one host: 128 prompts per step instead of 512 (4 optimiser steps per rollout
step instead of 16), and Qwen2.5-Math's 4096-token context instead of 2048 + 20480, so responses
stop at 3072 tokens and the overlong buffer shrinks with them (4096 * 3072 / 20480 ~ 512).

Training prompts: --config.data.train_files (no default: a run without it stops at start
naming the field; the dry run does not need it). Prompt files hold one record per problem with
`prompt` (the problem text; the "dapo" template adds DAPO-Math-17k's instruction) and `answer`
(rl/data/sources.py); DAPO-Math-17k's parquet stores the instruction inside a chat message and
the answer in reward_model.ground_truth, so flatten it to those two fields first. Held-out:
AIME 2024 from the pinned eval sets (rl/data EVAL_DIR: rl/data/eval, or
$SEEDRL_EVAL_DIR).

Parameters are float32 (bf16 compute): at lr 1e-6 an Adam step is far below half a bfloat16 ulp
of a typical weight, so bfloat16 parameters would not move.
"""

from configs import qwen
from rl.config.defaults import base_config

HF_DIRS = {"1.5b": "/models/Qwen2.5-Math-1.5B", "7b": "/models/Qwen2.5-Math-7B"}


def get_config(arg: str = "1.5b"):
  size = qwen.size_of(arg, "qwen2_5_math_dapo.py")
  # Qwen2.5-Math shares Qwen2.5's shapes but has a 4096-token context with rope_theta 1e4;
  # 3072 response tokens + prompts of up to 1024 tokens fill it.
  c = base_config(preset=qwen.SIZES[size], algorithm="dapo", rope_theta=10000.0,
                  max_seq_len=4096, param_dtype="float32")
  qwen.math_rl_on_one_gpu_host(c, size=size, hf_dir=HF_DIRS[size])
  c.rl.overlong_buffer = 512
  c.rl.overlong_factor = 1.0
  c.rl.max_num_gen_batches = 10
  return c.lock()
