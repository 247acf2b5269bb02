"""The JAX platform the launch scripts settle on before importing jax (launch/platforms.py):
CPU on a host without accelerators, with the installed CUDA plugin left unloaded, so a CPU run
prints none of the compilers' start-up noise; a host with an accelerator is left alone."""

import importlib.util
import os
import subprocess
import sys

import pytest

from launch import platforms

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# What jax prints on a CPU-only host once `launch/setup.sh --compilers` installed libtpu and the
# CUDA plugin (CUDA's C++ start-up line, the plugin's traceback, libtpu's hostname error).
NOISE = ("cudart_stub", "Could not find cuda drivers", "Traceback", "INVALID_ARGUMENT", "E0000")


def _python(code: str, **env) -> subprocess.CompletedProcess:
  environ = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=120, cwd=ROOT, env=dict(environ, **env))


def test_host_without_accelerator_runs_on_cpu_without_the_cuda_plugin():
  """No JAX_PLATFORMS and no accelerator: JAX_PLATFORMS=cpu, jax starts on CPU, and neither of
  the CUDA plugin's modules is loaded (jaxlib's import of it fails; jax's PJRT plugin registers
  nothing)."""
  out = _python(
      "import os, sys\n"
      "from launch import platforms\n"
      "platforms.settle(has_accelerator=lambda: False)\n"
      "import jax\n"
      "from jax._src import xla_bridge\n"
      "print(os.environ['JAX_PLATFORMS'], jax.devices()[0].platform,\n"
      "      sys.modules['jax_cuda12_plugin'] is None, 'cuda' in xla_bridge._backend_factories)\n")
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["cpu", "cpu", "True", "False"]
  assert not [line for line in out.stderr.splitlines() if any(n in line for n in NOISE)], (
      out.stderr[-2000:])


@pytest.mark.parametrize("environ,accelerator", [({}, True), ({"JAX_PLATFORMS": "tpu"}, False),
                                                 ({"JAX_PLATFORMS": "cuda"}, True)])
def test_accelerator_hosts_and_requests_are_left_alone(environ, accelerator, monkeypatch):
  """A host with a TPU or GPU, or a JAX_PLATFORMS naming one, keeps jax's own start-up (its
  failures are real errors): the environment and the loaded modules are unchanged."""
  before = dict(environ)
  modules = set(sys.modules)
  platforms.settle(environ, has_accelerator=lambda: accelerator)
  assert environ == before and set(sys.modules) == modules


@pytest.mark.parametrize("argv,left_out", [(["train.py", "--dry_run", "--topology=h100:8"], 0),
                                           (["plan.py", "--topology", "v5p:2x2x1"], 0),
                                           (["train.py", "--dry_run"], 4)])
def test_ahead_of_time_compiles_keep_the_cuda_plugin(argv, left_out):
  """`--topology` (a dry run compiling for a TPU slice or a GPU host, launch/aot.py) on a host
  without accelerators: JAX_PLATFORMS=cpu, and the CUDA plugin's modules stay loadable (a GPU
  topology is the plugin's); without the flag all four are left out."""
  out = _python(
      "import os, sys\n"
      "from launch import platforms\n"
      f"platforms.settle(has_accelerator=lambda: False, argv={argv!r})\n"
      "print(os.environ['JAX_PLATFORMS'], sum(m in sys.modules for m in\n"
      "      platforms._CUDA_MODULES + platforms._CUDA_PJRT_PLUGINS))\n")
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["cpu", str(left_out)]


def test_pci_probe_finds_a_google_tpu(tmp_path):
  """A Google TPU is found on the PCI bus by its vendor id, as jax finds it; other vendors are
  not accelerators."""
  (tmp_path / "0000:00:04.0").mkdir()
  (tmp_path / "0000:00:04.0" / "vendor").write_text("0x8086\n")
  assert platforms.host_has_accelerator(str(tmp_path)) is any(
      os.path.exists(n) for n in platforms._GPU_DEVICE_NODES)
  (tmp_path / "0000:00:05.0").mkdir()
  (tmp_path / "0000:00:05.0" / "vendor").write_text("0x1ae0\n")
  assert platforms.host_has_accelerator(str(tmp_path))


@pytest.mark.skipif(not any(importlib.util.find_spec(m) for m in ("libtpu", "jax_cuda12_plugin")),
                    reason="the compilers of `launch/setup.sh --compilers` are not installed")
@pytest.mark.skipif(platforms.host_has_accelerator(), reason="the host has an accelerator")
def test_train_help_prints_no_compiler_noise_on_a_cpu_host():
  """With libtpu and the CUDA plugin installed, a command on a CPU-only host (no JAX_PLATFORMS)
  prints none of their start-up lines."""
  out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
  assert not [line for line in out.stderr.splitlines() if any(n in line for n in NOISE)], (
      out.stderr[-2000:])
