"""Which JAX platform a launch script runs on, settled before jax is imported.

With the real compilers installed (`bash launch/setup.sh --compilers`: libtpu and the CUDA
plugin), jax tries both at start-up on any host: a CPU-only machine then prints CUDA's
"Could not find cuda drivers" lines, a CUDA traceback and libtpu's `E0000 ... INVALID_ARGUMENT`
about TPU worker hostnames before the first line of the run. `settle()` prevents that on a host
without accelerators, and only there:

* JAX_PLATFORMS unset and no TPU or GPU on the host (the probes jax itself uses: a Google TPU
  on the PCI bus, an NVIDIA or AMD device node): JAX_PLATFORMS=cpu, the platform jax would
  fall back to after its failed probes. A host whose accelerator these probes miss (a remote
  backend) names it: JAX_PLATFORMS=tpu or cuda.
* JAX_PLATFORMS=cpu (set by the user or above): the installed CUDA plugin is not loaded (its
  import alone prints from C++ before any log set-up); nothing on a CPU run uses it. Except
  with `--topology` on the command line (a dry run compiling ahead of time, launch/aot.py): a
  GPU topology such as h100:8 is the CUDA plugin's, so it stays, start-up lines and all.

A host with a TPU or GPU, or a JAX_PLATFORMS naming one, is left as it is: a failure to start
the accelerator there is a real error and stays on the console. Must run before jax (or
anything importing it) is imported: it edits the environment jax reads once.
"""

from __future__ import annotations

import glob
import os
import sys
import types
from collections.abc import MutableMapping, Sequence

_GOOGLE_PCI_VENDOR = "0x1ae0"  # jax/_src/hardware_utils.py: TPU chips on the PCI bus
_GPU_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")
# jaxlib imports kernels from the first of these it finds; jax imports every jax_plugins.* module
# and calls its initialize(), which for CUDA loads the PJRT library.
_CUDA_MODULES = ("jax_cuda13_plugin", "jax_cuda12_plugin")
_CUDA_PJRT_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def host_has_accelerator(pci_devices: str = "/sys/bus/pci/devices") -> bool:
  """A Google TPU on the PCI bus or a GPU device node (jax's own start-up probes)."""
  for vendor in glob.glob(os.path.join(pci_devices, "*", "vendor")):
    with open(vendor) as f:
      if f.read().strip() == _GOOGLE_PCI_VENDOR:
        return True
  return any(os.path.exists(node) for node in _GPU_DEVICE_NODES)


def _plugin_that_registers_nothing(name: str) -> types.ModuleType:
  module = types.ModuleType(name, "CUDA's PJRT plugin, left out of a CPU run (launch/platforms.py)")
  module.initialize = lambda: None
  return module


def settle(environ: MutableMapping[str, str] = os.environ,
           has_accelerator=host_has_accelerator, argv: Sequence[str] = sys.argv) -> None:
  """See the module docstring."""
  if not environ.get("JAX_PLATFORMS") and not has_accelerator():
    environ["JAX_PLATFORMS"] = "cpu"
  compiles_ahead = any(arg == "--topology" or arg.startswith("--topology=") for arg in argv[1:])
  if environ.get("JAX_PLATFORMS") != "cpu" or compiles_ahead:
    return
  for name in _CUDA_MODULES:
    sys.modules.setdefault(name, None)  # import raises ImportError: jaxlib goes on without it
  for name in _CUDA_PJRT_PLUGINS:
    sys.modules.setdefault(name, _plugin_that_registers_nothing(name))
