"""Thinking with tools: the tool-call format and tool registry (calls.py), the reasoning-retention
rule (context.py), environments as <environment, tools, task, verifier> tuples
(environments.py), the multi-turn rollout (rollout.py), per-environment rewards and metrics
(reward.py), expert transcripts and the SFT warm start (demonstrations.py), and what the RL
trainer calls: ToolEpisodes and its rollout source (episodes.py)."""
