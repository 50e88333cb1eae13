"""Compare two loss curves written by train_llama.py, step by step.

    python examples/compare_losses.py single.json dist.json --tol 1e-5

Prints one row per step (step, first run's loss, second run's loss, |difference|) and the largest
difference; exits with status 1 when that exceeds --tol or the runs have different step counts.
"""

from __future__ import annotations

import argparse
import json
import sys


def load(path: str) -> dict:
    try:
        with open(path) as f:
            record = json.load(f)
    except FileNotFoundError:
        raise SystemExit(f"{path} does not exist; did the training run that should write it fail?") from None
    if not isinstance(record.get("losses"), list):
        raise SystemExit(f"{path} has no 'losses' list; was it written by examples/train_llama.py --out?")
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="JSON from the single-device run")
    parser.add_argument("candidate", help="JSON from the distributed run")
    parser.add_argument("--tol", type=float, default=1e-5, help="largest allowed |difference| at any step")
    args = parser.parse_args(argv)

    reference, candidate = load(args.reference), load(args.candidate)
    ref_losses, cand_losses = reference["losses"], candidate["losses"]
    print(f"reference: {reference.get('mode', args.reference)}")
    print(f"candidate: {candidate.get('mode', args.candidate)}")
    print(f"{'step':>4}  {'reference loss':>16}  {'candidate loss':>16}  {'|diff|':>10}")
    diffs = []
    for step, (ref, cand) in enumerate(zip(ref_losses, cand_losses)):
        diffs.append(abs(ref - cand))
        print(f"{step:>4}  {ref:>16.9f}  {cand:>16.9f}  {diffs[-1]:>10.3e}")

    if len(ref_losses) != len(cand_losses):
        print(f"FAIL: {len(ref_losses)} reference steps but {len(cand_losses)} candidate steps")
        return 1
    worst = max(diffs, default=0.0)
    verdict = "OK" if worst <= args.tol else "FAIL"
    print(f"{verdict}: max |diff| = {worst:.3e} (tolerance {args.tol:.1e})")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
