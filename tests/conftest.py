"""Shared test set-up: 8 forced CPU devices (before jax is imported) and fp32 numerics."""

import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent XLA compilation cache for the whole run, shared by the xdist workers and the
# launchers the tests start (they inherit the environment): many tests compile the same tiny
# programs, and a cache hit is the executable compiled for the same HLO, options and flags.
# Named by the first process (pytest's, before it starts workers), made by jax at the first
# compile, removed when that process ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
      tempfile.gettempdir(), f"seedrl-test-xla-cache-{os.getpid()}")
  os.environ["SEEDRL_TEST_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

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
# the whole suite with the compilation cache on the 2-core CI host, 2026-11-28): with
# `pytest -n 2 --dist loadfile --no-loadscope-reorder` (CI) each file runs on one worker, and a
# long file scheduled last would leave the other idle (the learning gates, one file of three
# tests, once started 37 minutes into a run).
LONGEST_FILES = ("test_learning.py", "test_config_liveness.py", "test_trainer.py",
                 "test_model.py", "test_rollout.py", "test_multihost.py", "test_launch.py",
                 "test_gpu_check.py", "test_preference_jobs.py", "test_export_hf.py",
                 "test_hf.py", "test_moe_ep.py", "test_kernels.py", "test_planner.py",
                 "test_eval.py", "test_preference.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_sessionfinish(session):
  if os.environ.get("SEEDRL_TEST_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
