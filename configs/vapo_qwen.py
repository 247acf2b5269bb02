"""VAPO on Qwen2.5-1.5B (or 7B) base from a local Hugging Face checkpoint, one 8-GPU host.

  python launch/train.py --config=configs/vapo_qwen.py --workdir=/ckpt/vapo_qwen_1.5b \
      --config.data.train_files=/data/dapo_math_17k.parquet
  python launch/train.py --config=configs/vapo_qwen.py:7b --workdir=/ckpt/vapo_qwen_7b \
      --config.data.train_files=/data/dapo_math_17k.parquet
  python launch/train.py --config=configs/vapo_qwen.py --dry_run   # memory per GPU

The VAPO paper's settings (docs/rl_algorithms.md section 7: value pretraining for 50 steps,
decoupled GAE with lambda_critic = 1 and length-adaptive lambda_policy (alpha 0.05), clip
0.2 / 0.28, token-mean loss, positive-example NLL weight 0.1, +-1 rewards, actor lr 1e-6 and
critic lr 2e-6 after warm-up, value clip 0.5) on math prompts, scaled to one host: 128 prompts x
16 samples per step (paper: 512 x 16) and responses of up to 3072 tokens (paper: 20480; 2048 for
7B, whose policy and critic states leave less room for activations on 80 GB GPUs). The critic is
the policy's architecture with a scalar head, randomly initialised: the trainer does not load a
trunk into it (the paper starts the value model from a reward model).

Training prompts: --config.data.train_files (required to run, not to plan), records with
`prompt` and `answer` (rl/data/sources.py), as for configs/qwen2_5_math_dapo.py. Parameters
are float32 (bf16 compute) so that lr 1e-6 steps are not rounded away.
"""

from configs import qwen
from rl.config.defaults import base_config

HF_DIRS = {"1.5b": "/models/Qwen2.5-1.5B", "7b": "/models/Qwen2.5-7B"}


def get_config(arg: str = "1.5b"):
  size = qwen.size_of(arg, "vapo_qwen.py")
  c = base_config(preset=qwen.SIZES[size], algorithm="vapo",
                  param_dtype="float32")
  qwen.math_rl_on_one_gpu_host(c, size=size, hf_dir=HF_DIRS[size])
  c.rl.critic_warmup_steps = 50
  c.rl.lam_critic = 1.0
  c.rl.length_adaptive_alpha = 0.05
  c.rl.nll_coef = 0.1
  c.rl.value_clip = 0.5
  c.optim.critic_lr = 2e-6
  if size == "7b":
    c.rollout.max_new_tokens = 2048
  return c.lock()
