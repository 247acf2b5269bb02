"""Prompt data for RL: sources (jsonl / parquet / TFDS records and the grain pipeline),
templates, selection rules and curricula."""

import os

# The pinned public evaluation sets (GSM8K, MATH-500, AIME 2024/2025, AMC 2023): rl/data/eval
# (its README gives their origins and licences), or wherever $SEEDRL_EVAL_DIR points.
EVAL_DIR = os.environ.get("SEEDRL_EVAL_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "eval")
