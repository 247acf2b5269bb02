"""Shared test set-up: 8 forced CPU devices (before jax is imported) and fp32 numerics."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the XLA_FLAGS set-up)

jax.config.update("jax_default_matmul_precision", "highest")
