"""Prompt data for RL: sources (jsonl / parquet / TFDS records and the grain pipeline),
templates, selection rules and curricula."""
