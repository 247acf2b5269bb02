"""The demo: a tiny MoE + MLA + DSA policy learns two-digit addition with SFT then RL, on 2 CPU
cores.

  python launch/train.py --config=configs/demo.py                 # SFT cold start, then DAPO
  python launch/train.py --config=configs/demo.py:vapo            # ... then VAPO
  python launch/train.py --config=configs/demo.py:grpo_v32        # ... then DeepSeek-V3.2 GRPO

Stage 1 fine-tunes on worked solutions from an imperfect teacher: in 70% of the problems that
need a carry it forgets the carry (sft.carry_slip_rate), as a weak model's distilled data
would. Imitation learns the teacher, slips included, so the SFT checkpoint solves the carry-free
sums and few of the others. Stage 2 runs RL against our exact verifier, which checks the true
sum: the policy learns what its demonstrations got wrong. Held-out problems come from another
generator seed and are never trained on. The run ends with a table of the SFT and RL
checkpoints' held-out accuracy, writes <workdir>/results.json and a learning-curve PNG.
Rerunning the same command resumes.
"""

from rl.config.defaults import base_config


def get_config(arg: str = "dapo"):
  algorithm = arg or "dapo"
  c = base_config(preset="tiny_moe_mla_dsa", algorithm=algorithm,
                  d_model=96, mlp_dim=192, moe_mlp_dim=96, index_topk=8)
  c.job = "sft_rl"
  c.data.task = "addition"
  c.data.difficulty = 0  # a + b, both of up to two digits
  # 8,000 drawn problems (most of the 10,000 sums) seen 8 times each: the sum is learned in a
  # sudden transition (SFT loss ~0.3 -> ~0.06), and 4,000 problems seen 16 times left it to
  # chance whether it came within the 2,000 steps (seed 0 on an AVX-512 host: held-out 0.15).
  c.data.train_size = 8000
  c.data.heldout_size = 3000  # held-out questions also in the training set are removed
  c.rollout.max_new_tokens = 20
  c.rollout.prompt_bucket = 16
  c.sft.epochs = 8  # 2000 steps: imitation converges (the teacher's slips included)
  c.sft.batch_size = 32
  c.sft.lr = 2e-3
  c.sft.carry_slip_rate = 0.7
  # SFT's DSA stages. The model is trained from scratch, so 200 dense steps (the whole model
  # trains, the indexers fitted alongside) stand in for the trained dense checkpoint
  # DeepSeek-V3.2 starts from, and the frozen warm-up that fits the indexers to a trained
  # model's attention is skipped: with the library's default (200 frozen steps on the random
  # model, no dense stage) seeds 0 and 1 missed the transition the sum is learned in
  # (docs/demo.md, "The DSA stages").
  c.sft.dense_steps = 200
  c.sft.dense_warmup_steps = 0
  c.train.steps = 150
  c.train.prompts_per_step = 32
  c.train.samples_per_prompt = 8
  c.train.eval_every = 25
  c.train.checkpoint_every = 25
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 3
  c.rl.max_num_gen_batches = 4
  c.rl.fill_at_cap = True  # a policy that solves most sums keeps training on what varies
  c.rl.overlong_buffer = 4
  c.rl.indexer_coef = 1.0
  if algorithm == "grpo_v32":
    # Top-p alone, as DeepSeek-V3.2 samples: the keep-sampling-mask records each token's
    # nucleus (at most rollout.max_kept_ids ids; cut tokens are counted as kept_cut_tokens)
    # and the trainer's log-probs are renormalised over it.
    c.rollout.top_p = 0.95
  if algorithm == "vapo":
    # Length-adaptive GAE, lam_policy = 1 - 1 / (alpha * l), sets the advantage's horizon
    # 1 / (1 - lam) to alpha * l tokens. The paper's alpha = 0.05 is for responses of thousands
    # of tokens; on the demo's ~15 it gives lam_policy = 0 (clamped) for every response, so each
    # token's advantage is the critic's one-step TD error and the outcome reaches only the last
    # token. The critic never explained more than ~2% of the return variance here, and with
    # lam 0 the run collapsed after ~55 steps (responses ran to the length limit: docs/demo.md). At
    # alpha = 1 the horizon is the whole response (lam 0.93 at 15 tokens).
    c.rl.length_adaptive_alpha = 1.0
  return c.lock()
