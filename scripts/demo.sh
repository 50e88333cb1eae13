#!/usr/bin/env bash
# The README's demo: train the same tiny LLaMA on one device and on 4 CPU ranks (DP=2 x TP=2,
# sequence parallel, ZeRO-3), with dropout on, then compare the two loss curves step by step.
# Extra arguments go to both training runs, e.g. `bash scripts/demo.sh --steps 20 --model hf-llama`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test

out=out/demo
mkdir -p "$out"
# One intra-op thread per process: the 4 ranks share the machine's cores, and the single-device run
# uses the same setting so both runs do their arithmetic the same way.
export OMP_NUM_THREADS=1

.venv/bin/python examples/train_llama.py --dropout 0.1 --out "$out/single.json" "$@"
.venv/bin/torchrun --standalone --nproc-per-node 4 \
  examples/train_llama.py --dp 2 --tp 2 --dropout 0.1 --out "$out/dp2_tp2.json" "$@"
.venv/bin/python examples/compare_losses.py "$out/single.json" "$out/dp2_tp2.json"
