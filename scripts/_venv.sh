#!/usr/bin/env bash
# Sourced by tune.sh and test.sh: create .venv once and install tritune into it (editable).
# The venv sees system packages, so a GPU machine's own CUDA build of torch is used as is;
# where no torch is installed, the CPU build torch==2.13.0 is installed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv --system-site-packages .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! python -c "import torch" >/dev/null 2>&1; then
  pip install -q "torch==2.13.0"
fi
