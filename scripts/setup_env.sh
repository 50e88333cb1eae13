#!/usr/bin/env bash
# Creates ./.venv (once) and installs vescale with the extras named in $1 ("test" or "hf").
# torch is pinned so pip never resolves a CUDA build. A stamp (a hash of pyproject.toml and this
# script, per extras) skips pip when nothing it installs from changed since the last complete
# install: vescale itself is installed editable, so code changes need no reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python writes the bytecode of what it imports (its default): with PYTHONDONTWRITEBYTECODE set, as on
# some CI machines, and no .pyc installed (--no-compile below), every process (each test worker, each
# torchrun rank, each example run by a test) would compile torch's sources again: `import vescale`
# takes 14-17 s instead of 5-6 s on a 2-core machine. scripts/test.sh and demo.sh do the same.
unset PYTHONDONTWRITEBYTECODE
extras="${1:-test}"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=".venv/.vescale-setup-${extras}"
want="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  rm -f "$stamp"
  pip_install() {
    local status
    # --no-compile: no .pyc for the ~10K files of torch, transformers and the rest at install (74 of
    # 137 s on a fresh 2-core machine); Python compiles the modules it imports, once, on first use.
    .venv/bin/python -m pip install -q --disable-pip-version-check --no-compile "$@" 2>&1 | { grep -v '^WARNING: Location' || true; }
    status=${PIPESTATUS[0]}
    return "$status"
  }
  pip_install "torch==2.13.0"
  pip_install -e ".[${extras}]"
  # Also writes the bytecode of torch and vescale's imports, once, before the tests' processes start.
  .venv/bin/python -c "import torch, vescale; assert torch.__version__.startswith('2.13'), torch.__version__"
  echo "$want" > "$stamp"
fi
