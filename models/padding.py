"""Padded sizes: the one round-up to a multiple, for shape buckets.

Widths, batch sizes and tables are rounded up to a bucket so that jitted steps compile once per
bucket and sharded axes divide evenly. Pure Python with no dependencies, so models/, rl/,
launch/ and tests all import it (kernels/ cannot: it sits below models/).
"""

from __future__ import annotations


def round_up(value: int, multiple: int) -> int:
  """`value` rounded up to a multiple of `multiple` (> 0); exact for any int `value`."""
  return -(-value // multiple) * multiple
