"""Thinking with tools: RL on synthesised agentic tasks with multi-turn tool calls, on CPU.

  python launch/train.py --config=configs/tool_demo.py                # both environments
  python launch/train.py --config=configs/tool_demo.py:trip_planning  # one environment
  python launch/train.py --config=configs/tool_demo.py:code_math
  python launch/train.py --config=configs/tool_demo.py --config.tools.warm_start_steps=150

A tiny MoE + MLA + DSA policy (the demo's) runs DeepSeek-V3.2 GRPO over episodes of the tool
environments in rl/tool_use/environments.py: generation pauses at each `</tool_call>`, the host
runs the tool (the `python` tool in the sandbox), the result enters the context with
response_mask 0, and the episode goes on for up to `tools.max_turns` calls. The reward is the
environment's verifier; metrics are logged per environment (tools/<env>/success, turns,
tool_calls, tool_errors, turn_limit_rate). Keep-routing and keep-sampling-mask record each
episode's last engine round.

The policy starts untrained and almost never writes a well-formed call, so this shows the
machinery running end to end, not an agent that solves the tasks. The last command first fits
the policy to expert transcripts (rl/tool_use/demonstrations.py; the SFT loss on assistant tokens
falls from 5.6 to 1.4 in 60 steps), which teaches it the look of calls but, at this model size
and step count, still not well-formed ones.
"""

from rl.config.defaults import base_config

ENVIRONMENTS = ("trip_planning", "code_math")


def get_config(arg: str = ""):
  if arg and arg not in ENVIRONMENTS:
    raise ValueError(f"configs/tool_demo.py:{arg}: the argument must be empty or one of "
                     f"{list(ENVIRONMENTS)}")
  c = base_config(preset="tiny_moe_mla_dsa", algorithm="grpo_v32", d_model=96,
                  mlp_dim=192, moe_mlp_dim=96, index_topk=8, max_seq_len=2048)
  c.job = "rl"
  c.tools.enabled = True
  c.tools.environments = arg or ",".join(ENVIRONMENTS)
  c.tools.max_turns = 3
  c.tools.max_tool_tokens = 192
  c.tools.timeout_s = 5.0
  # warm_start_steps > 0: SFT on expert transcripts (tools really run) before RL; 8 rows a step.
  c.sft.batch_size = 8
  c.sft.lr = 2e-3
  c.data.train_size = 512
  c.data.heldout_size = 32
  c.rollout.max_new_tokens = 416  # policy tokens of a whole episode (an expert trip: ~400)
  c.rollout.prompt_bucket = 64
  c.train.steps = 20
  c.train.prompts_per_step = 4
  c.train.samples_per_prompt = 4
  c.train.eval_every = 10
  c.train.checkpoint_every = 10
  c.optim.lr = 3e-4
  c.optim.warmup_steps = 3
  c.rl.indexer_coef = 1.0
  return c.lock()
