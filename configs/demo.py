"""The demo: a tiny MoE + MLA + DSA policy learns arithmetic with SFT then RL, on 2 CPU cores.

  python launch/train.py --config=configs/demo.py                 # SFT cold start, then DAPO
  python launch/train.py --config=configs/demo.py:vapo            # ... then VAPO
  python launch/train.py --config=configs/demo.py:grpo_v32        # ... then DeepSeek-V3.2 GRPO

Stage 1 fine-tunes on generated worked solutions; stage 2 runs RL against our exact-arithmetic
verifier. Held-out problems come from another generator seed and are never trained on. The run
ends with a table of the SFT and RL checkpoints' held-out accuracy, writes
<workdir>/results.json and a learning-curve PNG. Rerunning the same command resumes.
"""

from configs import common


def get_config(arg: str = "dapo"):
  algorithm = arg or "dapo"
  c = common.base_config(preset="tiny_moe_mla_dsa", algorithm=algorithm,
                         d_model=96, mlp_dim=192, moe_mlp_dim=96, index_topk=8)
  c.job = "sft_rl"
  c.data.task = "arithmetic"
  c.data.difficulty = 1
  c.data.train_size = 4000
  c.data.heldout_size = 500
  c.rollout.max_new_tokens = 20
  c.rollout.prompt_bucket = 16
  c.sft.epochs = 8
  c.sft.batch_size = 32
  c.sft.lr = 2e-3
  c.train.steps = 400
  c.train.prompts_per_step = 16
  c.train.samples_per_prompt = 8
  c.train.eval_every = 50
  c.train.checkpoint_every = 50
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 3
  c.rl.max_num_gen_batches = 8
  c.rl.overlong_buffer = 4
  c.rl.indexer_coef = 1.0
  return c.lock()
