"""DAPO on Qwen3-30B-A3B (MoE: 128 experts, 8 active) from a local Hugging Face checkpoint, on a
TPU v5p slice of 16 chips (v5p:2x2x4). All 48 layers fit it by the compiler (compiled, not run).

  python launch/train.py --config=configs/qwen3_moe_dapo.py --dry_run --topology=v5p:2x2x4
  python launch/train.py --config=configs/qwen3_moe_dapo.py --workdir=gs://BUCKET/qwen3_moe \
      --config.data.train_files=gs://BUCKET/dapo_math_17k.parquet

The DAPO hyper-parameters of configs/qwen2_5_math_dapo.py (docs/rl_algorithms.md sections 6
and 8; configs/qwen.py `math_rl`) on the MoE: experts split over the "expert" axis (8 experts' worth of
16 per device, tokens exchanged all-to-all), parameters and optimiser state over FSDP. Parameters
are float32 for the reason given there (lr 1e-6 is below half a bfloat16 ulp of a weight).
Responses stop at 3072 tokens in a 4096-token context, as in the Qwen2.5-Math recipes.
"""

from configs import qwen
from rl.config.defaults import base_config

HF_DIR = "/models/Qwen3-30B-A3B-Base"


def get_config(arg: str = ""):
  if arg:
    raise ValueError(f"configs/qwen3_moe_dapo.py:{arg}: this recipe takes no argument")
  c = base_config(preset="qwen3-30b-a3b", algorithm="dapo", max_seq_len=4096,
                  param_dtype="float32")
  qwen.math_rl(c, hf_dir=HF_DIR)
  c.rl.overlong_buffer = 512
  c.rl.max_num_gen_batches = 10
  # Compiled, not run (docs/performance.md, 2026-11-27): all 48 layers on v5p:2x2x4, the
  # update takes 84.3 GiB per chip, the rollout 59.9 GiB (HBM 95 GiB). Remat "full" keeps
  # each layer's input; the scan recomputes one layer at a time in the backward pass.
  # Dropless: the compiler counts the expert FFN over the whole worst-case receive buffer (13.6x
  # the model's FLOPs unrolled at 4 layers, 2.96x with --config.model.moe_capacity_factor=1.25;
  # docs/performance.md). Whether the TPU skips the empty rows at run time is not measured.
  c.model.remat = "full"
  # 16 chips: experts over 8, FSDP over 2; a micro-batch holds one sequence per row shard.
  c.mesh.shape.update(data=1, fsdp=2, expert=8, tensor=1)
  c.mesh.devices = 16
  mini_batch = c.train.prompts_per_step * c.train.samples_per_prompt // c.train.mini_batches
  c.train.micro_batches = mini_batch // 16
  c.rollout.batch_size = 512
  c.rollout.prefill_batch = 64
  return c.lock()
