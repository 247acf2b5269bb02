"""DeepSeek-V3.2's GRPO on a DeepSeek-V3.2-shaped MoE (MLA + DSA) across a TPU v5p slice.

  python launch/train.py --config=configs/deepseek_v32_moe_tpu.py --dry_run --topology=v5p:8x8x8
  python launch/train.py --config=configs/deepseek_v32_moe_tpu.py:small --dry_run \
      --topology=v5p:4x4x2
  python launch/gke/render.py launch/gke/jobset_tpu.yaml NAME=v32-grpo IMAGE=<image> \
      WORKDIR=gs://<bucket>/v32-grpo TPU_ACCELERATOR=tpu-v5p-slice TPU_TOPOLOGY=8x8x8 HOSTS=128 \
      CHIPS_PER_HOST=4 MAX_RESTARTS=3 DATA_PVC=<claim> \
      -- --config=configs/deepseek_v32_moe_tpu.py \
      --config.data.train_files='/data/rl_prompts/*.parquet' | kubectl apply -f -
  ... same with TPU_TOPOLOGY=4x4x2 HOSTS=8 -- --config=configs/deepseek_v32_moe_tpu.py:small ...

Default: the deepseek-v3.2-671b preset (671B parameters, 37B active) on a v5p-1024 slice
(512 chips, 128 hosts): 8-way expert parallelism (32 of the 256 routed experts per group, tokens
exchanged by all-to-all, each pair's buffer bounded by a capacity factor of 1.25), 16-way FSDP
and 4-way tensor parallelism over heads, MLP and vocabulary. It starts from the released weights dequantised to bfloat16 (the FP8 release stores
128x128-block scales that models/hf.py does not read).

`:small`: the same architecture scaled down (5.1B parameters, 1.1B active: 12 layers, 64
experts, MLA latents 384 / 256, DSA top-512) on a v5p-64 slice (32 chips; 8-way expert, 2-way
FSDP, 2-way tensor parallelism): bring-up and throughput work before the full model; start it
from an SFT checkpoint (--config.init_checkpoint) or random init.

Training prompts (math, code and logic records, rl/data/sources.py) come from
--config.data.train_files: it has no default, and a run without it stops at start naming the
field (the dry run does not read it). Held out: AIME 2025 from the pinned eval sets.

Both use the Mosaic-TPU DSA kernels, streaming rollouts (half of each batch from the latest
policy, partials at most one version old) and the grpo_v32 recipe: unbiased KL (0.01),
off-policy sequence masking, keep-routing and keep-sampling-mask (rollouts sample with
top_p 0.95 within top_k 256, so the kept sets matter).

Memory (compiled, not run; docs/performance.md): all 61 layers, remat "full" (each layer's
input kept, one layer recomputed at a time in the scan's backward), the update takes 81.8 GiB
per v5p chip on 512 chips; on 256 chips 111 GiB (dropless: 126 GiB of temporaries alone).
The rollout (8192 sequences, 1024 slots) takes 72.4 GiB per chip on the same 512 chips.
The full model keeps the checkpoint's bfloat16 parameters, and AdamW runs on float32 master
weights kept in the optimiser state (`optim.master_weights`): in bfloat16 alone an Adam step of
lr 1e-6 is below half an ulp of a typical weight and rounds away. `:small` trains float32
parameters.
"""

import os

from rl.config.defaults import base_config
from rl.data import EVAL_DIR

SMALL = dict(
    vocab_size=129280, d_model=2048, n_layers=12, n_heads=16, mlp_dim=8192,
    q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    index_n_heads=16, index_head_dim=64, index_topk=512, n_experts=64, n_experts_per_tok=6,
    moe_mlp_dim=1024, n_shared_experts=1, first_k_dense=1, n_group=8, topk_group=4,
    max_seq_len=32768)


def get_config(arg: str = ""):
  if arg not in ("", "small"):
    raise ValueError(f"configs/deepseek_v32_moe_tpu.py:{arg}: the argument must be 'small' or "
                     "empty")
  small = arg == "small"
  c = base_config(preset="deepseek-v3.2-671b", algorithm="grpo_v32",
                  **(dict(SMALL, param_dtype="float32") if small else {}))
  if small:
    c.init_hf_dir = ""
    c.tokenizer = "/models/DeepSeek-V3.2-Exp-bf16"  # the full model's tokenizer
    c.mesh.shape.update(data=1, fsdp=2, expert=8, tensor=2)
  else:
    c.init_hf_dir = "/models/DeepSeek-V3.2-Exp-bf16"
    c.tokenizer = c.init_hf_dir
    c.mesh.shape.update(data=1, fsdp=16, expert=8, tensor=4)
    # All 61 layers need both to fit a v5p chip (module docstring).
    c.model.remat = "full"
    c.model.moe_capacity_factor = 1.25
  c.kernel_backend = "tpu"

  c.data.source = "files"
  c.data.heldout_files = os.path.join(EVAL_DIR, "aime25_test.jsonl")
  c.data.prompt_template = "chat"

  c.rollout.max_new_tokens = 8192
  c.rollout.temperature = 1.0
  c.rollout.top_p = 0.95
  # Keep-sampling-mask records each token's kept set as top_k int32 ids (rl/core/sampling.py):
  # top-p alone has no bound on it. 256 ids cost 1 KiB per token (a bit array over the 129k
  # vocabulary cost 16 KiB). The kept set is top-p over the 256 likeliest ids (where the 0.95
  # nucleus is wider, the 256 likeliest), recorded exactly, so the trainer's log-probs still
  # equal the sampler's.
  c.rollout.top_k = 256
  # Continuous batching: 1024 decode slots, 64 prompts prefilled per refill, instead of all
  # 8192 sequences of a step at once (samples do not depend on it). With it the :small rollout
  # compiles to 62.5 GiB per v5p chip on v5p:4x4x2; without, 1618 GiB (docs/performance.md).
  c.rollout.batch_size = 1024
  c.rollout.prefill_batch = 64
  c.rollout.prompt_bucket = 256
  c.rollout.streaming.update(enabled=True, on_policy_fraction=0.5, max_staleness=1,
                             round_tokens=1024)

  c.optim.lr = 1e-6
  c.optim.master_weights = not small  # bf16 parameters: AdamW on a float32 copy
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.1
  c.optim.grad_clip = 1.0
  c.optim.b1, c.optim.b2 = 0.9, 0.95

  c.train.steps = 1000
  c.train.prompts_per_step = 512
  c.train.samples_per_prompt = 16
  c.train.mini_batches = 16  # 512 sequences per optimiser step
  # One sequence per batch shard (data x fsdp x expert) per micro-batch.
  c.train.micro_batches = 32 if small else 4
  c.train.eval_every = 50
  c.train.checkpoint_every = 50
  return c.lock()
