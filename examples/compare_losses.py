"""Compare two loss curves written by train_llama.py, step by step.

    python examples/compare_losses.py single.json dist.json --tol 1e-5 --plot losses.png

Prints one row per step (step, first run's loss, second run's loss, |difference|) and the largest
difference; exits with status 1 when that exceeds --tol or the runs have different step counts.
``--plot`` also draws both loss curves and, below them, the per-step |difference| on a log axis
with the tolerance as a line (matplotlib, headless Agg backend).
"""

from __future__ import annotations

import argparse
import json
import os
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


def plot(path: str, reference: dict, candidate: dict, tol: float) -> None:
    """Loss curves (top) and per-step |difference| against the tolerance, log scale (bottom)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    ref, cand = reference["losses"], candidate["losses"]
    steps = range(min(len(ref), len(cand)))
    diffs = [abs(ref[i] - cand[i]) for i in steps]
    # A log axis cannot show 0 (bit-identical losses): draw those at a floor below every other point.
    positive = [d for d in diffs if d > 0]
    floor = min(positive + [tol]) / 10
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 6), gridspec_kw={"height_ratios": [3, 2]})
    top.plot(range(len(ref)), ref, "o-", label=f"reference: {reference.get('mode', 'run a')}")
    top.plot(range(len(cand)), cand, "x--", label=f"candidate: {candidate.get('mode', 'run b')}")
    top.set_ylabel("loss")
    top.legend(fontsize=8)
    top.set_title("Loss per step, and how far the two runs are apart")
    # NaN breaks the line at identical steps instead of drawing it down to the floor.
    bottom.semilogy(list(steps), [d if d > 0 else float("nan") for d in diffs], "s-", color="tab:red", label="|difference|")
    zeros = [i for i in steps if diffs[i] == 0]
    if zeros:
        bottom.semilogy(zeros, [floor] * len(zeros), "v", color="tab:green", label="identical (0)")
    bottom.axhline(tol, color="black", linestyle=":", label=f"tolerance {tol:.0e}")
    bottom.set_ylim(floor / 3, max(diffs + [tol]) * 300)  # room for the legend above the tolerance line
    bottom.set_xlabel("step")
    bottom.set_ylabel("|loss difference|")
    bottom.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", help="JSON from the single-device run")
    parser.add_argument("candidate", help="JSON from the distributed run")
    parser.add_argument("--tol", type=float, default=1e-5, help="largest allowed |difference| at any step")
    parser.add_argument("--plot", metavar="PNG", help="also draw the curves and differences into this image")
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

    if args.plot:
        plot(args.plot, reference, candidate, args.tol)
    if len(ref_losses) != len(cand_losses):
        print(f"FAIL: {len(ref_losses)} reference steps but {len(cand_losses)} candidate steps")
        return 1
    worst = max(diffs, default=0.0)
    verdict = "OK" if worst <= args.tol else "FAIL"
    print(f"{verdict}: max |diff| = {worst:.3e} (tolerance {args.tol:.1e})")
    return 0 if verdict == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
