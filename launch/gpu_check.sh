#!/usr/bin/env bash
# The GPU check (launch/gpu_check.py; what it measures and how to read it: docs/gpu.md). On the
# lent GPU machine it first installs the carried wheels (.whl/, made here by
# launch/gather_wheels.sh) into /tmp/seedrl_site with no index (that machine reaches no
# registry), then runs every step and writes OUT_DIR/results.json, results.md and steps.log.
# Exits 1 when any step failed, 2 when a package is missing.
#
#   bash launch/gpu_check.sh OUT_DIR --steps=env,pytest,dsa,demo      # the first of two calls
#   bash launch/gpu_check.sh OUT_DIR --steps=env,rollout,train        # the second
#   bash launch/gpu_check.sh OUT_DIR --steps=rollout --budgets=rollout:300 --total=320
#   bash launch/gpu_check.sh OUT_DIR --smoke                          # tiny sizes, CPU, no wheels
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash launch/gpu_check.sh OUT_DIR [--smoke] [--steps=a,b] [--budgets=step:s] [--total=s]"
out="${1:?$usage}"
shift
python="${PYTHON:-python3}"
if [[ " $* " != *" --smoke "* ]]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/seedrl_site .whl/*.whl || exit 2
    export PYTHONPATH="/tmp/seedrl_site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  missing=$("$python" -c '
import importlib.util
names = ("ml_collections", "grain", "math_verify", "tensorboardX", "jax", "flax", "optax",
         "orbax.checkpoint", "torch", "transformers", "pytest")
print(" ".join(n for n in names if importlib.util.find_spec(n.split(".")[0]) is None))')
  if [ -n "$missing" ]; then
    echo "gpu_check: missing Python packages: $missing (run bash launch/gather_wheels.sh on a" \
      "machine with a registry and carry .whl)" >&2
    exit 2
  fi
fi
exec "$python" -m launch.gpu_check --out="$out" "$@"
