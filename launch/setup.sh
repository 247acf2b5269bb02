#!/usr/bin/env bash
# Installs seedrl on a fresh Debian machine: Python packages, then (with --test) the test-only
# references (CPU torch + transformers) and the code sandbox (bubblewrap + a non-root user).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements.txt
python -m pip install -q -e . --no-deps
if [ "${1:-}" = "--test" ]; then
  python -m pip install -q -r requirements-test.txt
fi
if [ -f launch/setup_sandbox.sh ]; then
  bash launch/setup_sandbox.sh
fi
