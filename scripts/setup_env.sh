#!/usr/bin/env bash
# Creates ./.venv (once) and installs vescale with the extras named in $1 ("test" or "hf").
# torch is pinned so pip never resolves a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[${extras}]" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import torch, vescale; assert torch.__version__.startswith('2.13'), torch.__version__"
