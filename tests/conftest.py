"""Shared test set-up: 8 forced CPU devices (before jax is imported) and fp32 numerics."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the XLA_FLAGS set-up)
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def expert_parallel_choices(monkeypatch):
  """The list of MoE dispatch choices (True: expert-parallel) made while the test runs: the
  MoE layer picks expert parallelism from the ambient mesh through moe_ep.dispatch_for_mesh."""
  from models import moe_ep
  choices = []
  dispatch = moe_ep.dispatch_for_mesh

  def spy(local_fn, mesh=None, **kwargs):
    experts = dispatch(local_fn, mesh, **kwargs)
    choices.append(experts is not local_fn)
    return experts

  monkeypatch.setattr(moe_ep, "dispatch_for_mesh", spy)
  return choices


# Files whose tests take the longest, longest first (test time per file, `--durations=0` of
# the whole suite on the 2-core CI host, 2026-11-28): with `pytest -n 2 --dist loadfile` (CI)
# each file runs on one worker, and a long file scheduled last would leave the other idle.
LONGEST_FILES = ("test_trainer.py", "test_config_liveness.py", "test_learning.py",
                 "test_model.py", "test_eval.py", "test_hf.py", "test_launch.py",
                 "test_rollout.py", "test_moe_ep.py", "test_multihost.py", "test_gpu_check.py",
                 "test_resume.py", "test_export_hf.py", "test_sampling.py", "test_kernels.py",
                 "test_notebook.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
