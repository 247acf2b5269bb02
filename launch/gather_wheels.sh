#!/usr/bin/env bash
# Downloads, here, the wheels the GPU check (launch/gpu_check.sh) needs beyond what the lent GPU
# machine has (Python 3.12, jax 0.11 + CUDA plugin, flax, optax, orbax, chex, torch,
# transformers, pytest, ...; no package registry there): Python 3.12 x86-64 manylinux wheels, at
# the versions requirements.lock pins, into .whl/ (ignored by git), which the device call
# carries. Each package's dependencies are listed here by hand (pip runs with --no-deps, one
# version of each); the ones not listed (absl-py, etils, numpy, protobuf, sympy, pyyaml, ...)
# are on the machine.
#
#   bash launch/gather_wheels.sh [DIR]     # default DIR: .whl
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
# name: what needs it
packages=(
  ml-collections          # configs (ml_collections.ConfigDict, config_flags)
  grain                   # rl/data (the prompt pipeline)
  array-record            # grain
  portpicker              # grain
  math-verify             # rl/rewards/math_verifier.py
  latex2sympy2-extended   # math-verify
  antlr4-python3-runtime  # latex2sympy2-extended
  tensorboardx            # rl/jobs/checkpoint.py (the demo's TensorBoard scalars)
)
pins=()
for name in "${packages[@]}"; do
  pin=$(grep -i -m1 "^${name}==" requirements.lock || true)
  if [ -z "$pin" ]; then
    echo "gather_wheels: $name is not pinned in requirements.lock" >&2
    exit 2
  fi
  pins+=("$pin")
done
rm -rf "$dest"
mkdir -p "$dest"
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"
count=$(ls "$dest"/*.whl | wc -l)
if [ "$count" -ne "${#pins[@]}" ]; then
  echo "gather_wheels: got $count wheels for ${#pins[@]} pins" >&2
  exit 1
fi
echo "${pins[*]}"
echo "$count wheels, $(du -sh "$dest" | cut -f1) in $dest"
