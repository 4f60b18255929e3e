#!/usr/bin/env bash
# Set up .venv with the test extras, lint, type-check, then run the CPU test tier (CI runs this too)
# (kernels on the Triton interpreter at tiny shapes; GPU-tier tests skip without a GPU).
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -k prefill
# The distributed-tuning tests against PostgreSQL need TRITUNE_TEST_POSTGRES_URL and skip without it
# (.ci/run starts a server on loopback and sets it; with CI=true they fail instead of skipping).
set -euo pipefail
. "$(dirname "$0")/_venv.sh"
workers=()
if python -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then
  # CPU tier: the interpreter's Triton must match the GPU machine's.
  pip install -q "triton==3.6.0"
  # CPU tier: test files spread over two processes, each file's tests together in one (-n 0: one process).
  # Not on a GPU, where two processes on one card would disturb the timing and memory tests.
  workers=(-n 2 --dist loadfile)
fi
pip install -q -e ".[dev]"
ruff check .
ruff format --check .
# Strict typing where the style asks for it (settings in pyproject.toml).
mypy --strict tuner configs_db search_spaces
exec python -m pytest "${workers[@]}" "$@"
