#!/usr/bin/env bash
# The seeds' claims on the demo task (docs/experiments.md), one command:
#
#   bash launch/experiments.sh [ROOT]        # default ROOT: workdir/experiments
#
# 1. The demo's SFT stage, seed 0 (`launch/train.py --config=configs/demo.py --config.job=sft`),
#    in ROOT/sft: every RL run below starts from this one checkpoint.
# 2. One launch/sweep.py sweep per claim, RL seeds 0-2, each in ROOT/<claim>: 40 RL steps,
#    held-out evaluation every 5, four mini-batches per step (so later mini-batches are
#    off-policy and the clip, the off-policy mask and the KL estimator can act; one mini-batch,
#    the demo's, keeps every ratio at 1), the training problems the SFT stage's
#    (data.train_seed=0) so the held-out set stays unseen for every seed.
# A sweep's first grid point is the recipe as configs/demo.py sets it: a finished run of it is
# linked in, not run again. Rerunning the command skips finished runs and resumes the others
# (launch/sweep.py). Each ROOT/<claim>/sweep.md is a table (final accuracy, entropy, steps and RL
# wall time to a held-out accuracy of 0.95), with plots beside it.
#
# EXTRA (config overrides, space-separated) goes to the SFT stage and to every RL run, STEPS
# (default 40) sets the RL steps and TARGET (default 0.95) the held-out accuracy the tables count
# steps and wall time to, e.g. a weaker teacher that leaves RL more to learn:
#
#   EXTRA="--config.sft.carry_slip_rate=0.9" STEPS=60 TARGET=0.9 bash launch/experiments.sh ROOT
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(realpath -m "${1:-workdir/experiments}")
PARALLEL=${PARALLEL:-2}
mkdir -p "$ROOT"
read -r -a EXTRA <<< "${EXTRA:-}"
STEPS=${STEPS:-40}
TARGET=${TARGET:-0.95}
python launch/train.py --config=configs/demo.py --config.job=sft ${EXTRA[@]+"${EXTRA[@]}"} \
  --workdir="$ROOT/sft"
COMMON=(--config.job=rl "--config.init_checkpoint=$ROOT/sft/checkpoints"
        --config.data.train_seed=0 "--config.train.steps=$STEPS" --config.train.eval_every=5
        "--config.train.checkpoint_every=$STEPS" --config.train.mini_batches=4
        ${EXTRA[@]+"${EXTRA[@]}"})

sweep() {  # sweep <config> <claim> [grid]
  python launch/sweep.py "--config=$1" "${COMMON[@]}" --seeds=0,1,2 --parallel="$PARALLEL" \
    "--target=$TARGET" "--root=$ROOT/$2" ${3:+"--grid=$3"}
}

reuse() {  # reuse <finished run prefix> <run prefix>: link a finished run's three seeds
  mkdir -p "$(dirname "$ROOT/$2")"
  for seed in 0 1 2; do ln -sfn "$ROOT/$1seed=$seed" "$ROOT/$2seed=$seed"; done
}

# DAPO: clip-higher against symmetric clipping, dynamic sampling.
sweep configs/demo.py dapo_clip 'rl.clip_high=0.28,0.2'
reuse dapo_clip/rl.clip_high=0.28, dapo_ds/rl.dynamic_sampling=True,
sweep configs/demo.py dapo_ds 'rl.dynamic_sampling=True,False'
# The recipes side by side (DAPO is dapo_clip's first point).
for recipe in grpo grpo_v32 vapo; do sweep "configs/demo.py:$recipe" "$recipe"; done
python launch/sweep.py "--root=$ROOT/recipes" "--target=$TARGET" --points="DAPO=$ROOT/dapo_clip/\
rl.clip_high=0.28,;GRPO=$ROOT/grpo/;grpo_v32=$ROOT/grpo_v32/;VAPO=$ROOT/vapo/"
# VAPO: value pretraining. DeepSeek-V3.2's GRPO: off-policy sequence masking, the unbiased KL
# estimate against k3.
reuse vapo/ vapo_pretrain/rl.critic_warmup_steps=10,
sweep configs/demo.py:vapo vapo_pretrain 'rl.critic_warmup_steps=10,0'
reuse grpo_v32/ v32_mask/rl.offpolicy_mask_delta=0.1,
sweep configs/demo.py:grpo_v32 v32_mask 'rl.offpolicy_mask_delta=0.1,0.0'
reuse grpo_v32/ v32_kl/rl.kl_kind=unbiased,
sweep configs/demo.py:grpo_v32 v32_kl 'rl.kl_kind=unbiased,k3'
# Last, the two claims about long responses, which sums' ~15-token solutions cannot show:
# token- against sequence-mean loss (DAPO), length-adaptive GAE (VAPO; alpha 0: fixed lambda 1).
reuse dapo_clip/rl.clip_high=0.28, dapo_agg/rl.loss_agg_mode=token-mean,
sweep configs/demo.py dapo_agg 'rl.loss_agg_mode=token-mean,seq-mean-token-mean'
reuse vapo/ vapo_lagae/rl.length_adaptive_alpha=1.0,
sweep configs/demo.py:vapo vapo_lagae 'rl.length_adaptive_alpha=1.0,0.0'
echo "tables: $ROOT/*/sweep.md"
