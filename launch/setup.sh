#!/usr/bin/env bash
# Installs seedrl on a fresh Debian machine: Python packages, then (with --test) the test-only
# references (CPU torch + transformers) and the code sandbox (bubblewrap + a non-root user).
set -euo pipefail
cd "$(dirname "$0")/.."
# requirements.lock pins every transitive dependency (generated from requirements-test.txt by
# pip-compile; the command is in its header): the same versions on every machine.
python -m pip install -q -r requirements.txt -c requirements.lock
python -m pip install -q -e . --no-deps
if [ "${1:-}" = "--test" ]; then
  python -m pip install -q -r requirements-test.txt -c requirements.lock
fi
if [ -f launch/setup_sandbox.sh ]; then
  bash launch/setup_sandbox.sh
fi
