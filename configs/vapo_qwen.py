"""VAPO on Qwen2.5-1.5B (or 7B) base from a local Hugging Face checkpoint, one 8-GPU host.

  python launch/train.py --config=configs/vapo_qwen.py --workdir=/ckpt/vapo_qwen_1.5b
  python launch/train.py --config=configs/vapo_qwen.py:7b --workdir=/ckpt/vapo_qwen_7b
  python launch/train.py --config=configs/vapo_qwen.py --dry_run   # memory per GPU

The VAPO paper's settings (spec/rl_algorithms.md section 7: value pretraining for 50 steps,
decoupled GAE with lambda_critic = 1 and length-adaptive lambda_policy (alpha 0.05), clip
0.2 / 0.28, token-mean loss, positive-example NLL weight 0.1, +-1 rewards, actor lr 1e-6 and
critic lr 2e-6 after warm-up, value clip 0.5) on math prompts, scaled to one host: 128 prompts x
16 samples per step (paper: 512 x 16) and responses of up to 3072 tokens (paper: 20480; 2048 for
7B, whose policy and critic states leave less room for activations on 80 GB GPUs). The critic is
the policy's trunk with a scalar head, initialised from the same checkpoint.

Prompt files: records with `prompt` and `answer` (rl/data/sources.py), as for
configs/qwen2_5_math_dapo.py. Parameters are float32 (bf16 compute) so that lr 1e-6 steps are not
rounded away.
"""

import os

from configs import common
from rl.data import EVAL_DIR

HF_DIRS = {"1.5b": "/models/Qwen2.5-1.5B", "7b": "/models/Qwen2.5-7B"}
PRESETS = {"1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b"}


def get_config(arg: str = "1.5b"):
  size = arg or "1.5b"
  if size not in PRESETS:
    raise ValueError(f"configs/vapo_qwen.py:{arg}: the argument must be one of "
                     f"{sorted(PRESETS)}")
  c = common.base_config(preset=PRESETS[size], algorithm="vapo", param_dtype="float32")
  c.init_hf_dir = HF_DIRS[size]
  c.tokenizer = HF_DIRS[size]

  c.data.source = "files"
  c.data.train_files = "/data/dapo_math_17k.parquet"
  c.data.heldout_files = os.path.join(EVAL_DIR, "aime24_test.jsonl")
  c.data.prompt_template = "dapo"

  c.rollout.max_new_tokens = 3072
  c.rollout.temperature = 1.0
  c.rollout.top_p = 1.0
  c.rollout.prompt_bucket = 128

  c.rl.critic_warmup_steps = 50
  c.rl.lam_critic = 1.0
  c.rl.length_adaptive_alpha = 0.05
  c.rl.clip_low, c.rl.clip_high = 0.2, 0.28
  c.rl.loss_agg_mode = "token-mean"
  c.rl.nll_coef = 0.1
  c.rl.value_clip = 0.5

  c.optim.lr = 1e-6
  c.optim.critic_lr = 2e-6
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.1
  c.optim.grad_clip = 1.0
  c.optim.b1, c.optim.b2 = 0.9, 0.999

  c.train.steps = 500
  c.train.prompts_per_step = 128
  c.train.samples_per_prompt = 16
  c.train.mini_batches = 4  # 512 sequences per optimiser step
  c.train.eval_every = 25
  c.train.checkpoint_every = 25
  # As in configs/qwen2_5_math_dapo.py: tensor parallelism within GPU groups, FSDP across
  # them, one sequence per group per micro-batch.
  tensor = 2 if size == "1.5b" else 4
  c.mesh.shape.update(data=1, fsdp=8 // tensor, tensor=tensor)
  mini_batch = c.train.prompts_per_step * c.train.samples_per_prompt // c.train.mini_batches
  c.train.micro_batches = mini_batch // (8 // tensor)
  if size == "7b":
    c.rollout.max_new_tokens = 2048
  return c.lock()
