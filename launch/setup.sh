#!/usr/bin/env bash
# Installs seedrl on a fresh Debian machine: Python packages, then (with --test) the test-only
# references (CPU torch + transformers) and the code sandbox (bubblewrap + a non-root user).
# With --compilers: only the real compilers for the compile gate (`pytest -m compile`): libtpu
# (XLA:TPU and Mosaic, ahead of time for TPU topologies on any host) and the CUDA plugin (Pallas'
# Triton lowering, and XLA:GPU for compile-only GPU topologies; installed without its CUDA
# libraries: lowering and compiling need none) with CUDA's ptxas and libdevice (nvcc's wheel),
# which XLA:GPU compiles PTX to machine code with. Both make jax probe for a TPU / GPU at
# start-up: run CPU work beside them with JAX_PLATFORMS=cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
# requirements.lock pins every transitive dependency (generated from requirements-test.txt by
# pip-compile; the command is in its header): the same versions on every machine.
if [ "${1:-}" = "--compilers" ]; then
  python -m pip install -q "libtpu==0.0.42.1"
  python -m pip install -q --no-deps "jax-cuda12-plugin==0.10.2" "jax-cuda12-pjrt==0.10.2" \
      "nvidia-cuda-nvcc-cu12==12.9.86"
  exit 0
fi
python -m pip install -q -r requirements.txt -c requirements.lock
python -m pip install -q -e . --no-deps
if [ "${1:-}" = "--test" ]; then
  python -m pip install -q -r requirements-test.txt -c requirements.lock
fi
if [ -f launch/setup_sandbox.sh ]; then
  bash launch/setup_sandbox.sh
fi
