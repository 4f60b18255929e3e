#!/usr/bin/env bash
# Set up .venv, then tune the TMA prefill kernel on GPU 0, or on the Triton
# interpreter at tiny shapes when the machine has no GPU (the command says which).
# Extra arguments go to `tune`, e.g.  bash scripts/tune.sh --trials 10
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
pip install -q -e ".[tune]"
exec tune --device auto --kernel tma_prefill "$@"
