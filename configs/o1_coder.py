"""O1-Coder on generated programming tasks with the tiny model, on CPU (rl/o1_coder/selfplay.py).

  python launch/train.py --config=configs/o1_coder.py --workdir=/tmp/o1_coder  # pair-wise PRM
  python launch/train.py --config=configs/o1_coder.py:pointwise      # point-wise (BCE) PRM
  python launch/train.py --config=configs/o1_coder.py:test           # a minutes-long smoke run

Measured 2026-11-23 (2-core CPU, 459 s, before the D+ warm start was added): TCG metric 0.021
after SFT -> 0.098 after DPO; PRM held-out sibling-pair accuracy 0.37 untrained -> 0.65 (28 of
43 pairs; one-sided binomial p = 0.03 against chance); policy pass rate after one self-play
iteration: held-out greedy 0.65 -> 0.76, training tasks sampled 0.17 -> 0.42. The point-wise
PRM with 30 search trees was at chance (0.52 on 29 pairs): it needs more search data than this
config affords.

Stages: the test-case generator (SFT, then DPO on matched vs shuffled-output cases; metric: the
fraction of its held-out cases the reference solution reproduces in the sandbox); a bootstrap
policy fine-tuned on templated plan -> refine -> code paths (a quarter of them consistent but
wrong, so search trees branch into good and bad steps); then `o1.iterations` rounds of MCTS
reasoning-data synthesis, a PRM fit on D_process (held-out sibling-pair accuracy) and GRPO on
phi = alpha(t) R + (1 - alpha(t)) mean_j gamma^j r_j; in the first round the policy is first
initialised by SFT on the search's correct paths D+ (O1-Coder section 3.3). Policy pass rates
are measured before, after the D+ warm start and after RL. Tasks whose TCG cases the reference
reproduces are graded on those cases. Everything is written to <workdir>/results.json, the
TCG, PRM and policy to <workdir>/models/ (rl/o1_coder/selfplay.py load_model). Needs the
sandbox (`bash launch/setup_sandbox.sh`). The `o1` section's fields, defaults and meaning are
rl/config/defaults.py base_config's; this recipe sets only what it changes.
"""

from rl.config.defaults import base_config


def get_config(arg: str = ""):
  variant = arg or "pairwise"
  if variant not in ("pointwise", "pairwise", "test"):
    raise ValueError(f"configs/o1_coder.py:{arg}: the argument must be pointwise, pairwise or "
                     "test")
  c = base_config(preset="tiny_dense", algorithm="grpo")
  c.job = "o1_coder"
  c.rl.kl_coef = 0.0  # no reference model on CPU
  c.rollout.max_new_tokens = 128  # the longest templated path is 123 tokens + eos
  c.rollout.prompt_bucket = 64
  c.sft.lr = 3e-3
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 1
  c.train.steps = 6
  c.train.prompts_per_step = 8
  c.train.samples_per_prompt = 4
  c.train.log_every = 1
  # config.o1 (rl/config/defaults.py) defaults to this recipe's pair-wise run: 50 search tasks
  # are every training task (of the 67 generated, 17 are held out).
  if variant != "pairwise":
    c.o1.prm_mode = "pointwise"
  if variant == "test":
    c.train.steps = 2
    c.train.prompts_per_step = 4
    c.o1.update(tcg_sft_steps=20, tcg_dpo_steps=5, sft_examples=200, sft_steps=30,
                dplus_sft_steps=5, search_tasks=4, simulations=3, branching=2, prm_steps=10,
                eval_samples=1)
  return c.lock()
