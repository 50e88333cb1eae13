"""Compare two records made by ``vescale.debug.record`` and name the first tensor where they part.

``compare_runs(a, b, rtol, atol, stol)`` walks run ``a``'s tensors in execution order (step by step:
parameter values, module outputs as modules return, gradients as backward accumulates them) and
checks each against run ``b`` elementwise: ``|a - b| <= atol + rtol * |a| + stol * rms(a)`` (NaN
matches NaN, equal infinities match), where ``rms(a)`` is the root mean square of ``a``'s whole
tensor. The first tensor beyond tolerance is where the runs part; everything after it usually
differs only as a consequence. ``python -m vescale.debug.compare`` is the command line.

Records of different models, step counts or tensor sets cannot be compared: ``RecordMismatch``
says what differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Collection, Sequence

import torch

from .record import FORMAT, INDEX

__all__ = ["compare_runs", "Comparison", "TensorDiff", "RecordMismatch", "load_index", "main"]

# fp32 results of the same math reduced in another order (sharded matmuls, collectives) differ by a
# few ulps per reduction, amplified a little through the layers: 1e-5 relative and absolute has
# room above that. An optimiser step magnifies that noise where it normalises a gradient near zero
# (AdamW moves such an element by lr * g / (|g| + eps)): one element in thousands then differs by up
# to 4.5e-4 of its tensor's RMS, and the modules reading it pass that on (measured, tiny LLaMA, 4
# AdamW steps at lr 3e-3, TP=2 / TP=2 + SP / DP=2 + ZeRO-3 against one device). stol = 1e-3 of the
# tensor's RMS covers that and stays far below what a wrong plan, seed or reshape causes (a wrong
# dropout seed: 9x the RMS; see docs/debug.md).
DEFAULT_RTOL, DEFAULT_ATOL, DEFAULT_STOL = 1e-5, 1e-5, 1e-3
WORST_SHOWN = 5
TABLE_ROWS = 20


class RecordMismatch(ValueError):
    """Two records that cannot be compared tensor by tensor (other model, steps or tensor set)."""


def load_index(directory: str) -> dict:
    path = os.path.join(directory, INDEX)
    try:
        with open(path) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise RecordMismatch(f"{directory} holds no record ({INDEX} is missing); make one with vescale.debug.record") from None
    except json.JSONDecodeError as e:
        raise RecordMismatch(f"{path} is not valid JSON ({e}); was the recording interrupted?") from None
    if index.get("format") != FORMAT:
        raise RecordMismatch(f"{path} has format {index.get('format')!r}, this comparer reads {FORMAT!r}")
    return index


def _check_comparable(a: str, ia: dict, b: str, ib: dict) -> None:
    pa, pb = ia["model"]["parameters"], ib["model"]["parameters"]
    if pa != pb:
        only_a, only_b = sorted(set(pa) - set(pb)), sorted(set(pb) - set(pa))
        reshaped = [f"{n} {pa[n]} vs {pb[n]}" for n in pa if n in pb and pa[n] != pb[n]]
        detail = "; ".join(
            part for part in (
                f"parameters only in {a}: {only_a[:3]}" if only_a else "",
                f"parameters only in {b}: {only_b[:3]}" if only_b else "",
                f"different shapes: {reshaped[:3]}" if reshaped else "",
            ) if part
        )
        raise RecordMismatch(
            f"{a} records {ia['model']['class']} and {b} records {ib['model']['class']}, which are not the same model "
            f"({detail}); record the same model in both runs"
        )
    if ia["steps"] != ib["steps"]:
        raise RecordMismatch(
            f"{a} holds steps 0..{ia['steps'] - 1} and {b} holds steps 0..{ib['steps'] - 1}; "
            "record both runs with the same steps= (and let both run that many steps)"
        )
    keys_a = {(e["step"], e["key"]) for e in ia["entries"]}
    keys_b = {(e["step"], e["key"]) for e in ib["entries"]}
    if keys_a != keys_b:
        def show(keys: Collection[tuple[int, str]]) -> str:
            return ", ".join(f"step {s} {k}" for s, k in sorted(keys)[:5]) + (" ..." if len(keys) > 5 else "")

        only_a, only_b = keys_a - keys_b, keys_b - keys_a
        raise RecordMismatch(
            f"{a} and {b} recorded different tensor sets"
            + (f"; only in {a} ({len(only_a)}): {show(only_a)}" if only_a else "")
            + (f"; only in {b} ({len(only_b)}): {show(only_b)}" if only_b else "")
            + ". Both runs must run the same modules the same number of times per step"
        )


@dataclasses.dataclass
class TensorDiff:
    """How one recorded tensor differs between the runs (``shape_b != shape_a`` or some elements)."""

    step: int
    key: str
    entry: dict
    shape_a: tuple
    shape_b: tuple
    max_abs: float = 0.0
    max_rel: float = 0.0
    rms: float = 0.0  # root mean square of run a's tensor (the scale of stol)
    beyond: int = 0  # elements beyond tolerance
    worst: list = dataclasses.field(default_factory=list)  # (index, a, b, |a-b|) worst first

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape_a).numel())

    @property
    def where(self) -> str:
        kind, e = self.entry["kind"], self.entry
        if kind == "out":
            field = self.key.split("#", 1)[1].lstrip("0123456789")
            return f"output{field or ''} of module '{e['module']}' (call {e['call']})"
        return f"{'value' if kind == 'param' else 'gradient'} of parameter '{e['name']}'"

    def details(self, a_name: str, b_name: str) -> str:
        lines = [f"step {self.step}, {self.where}  [{self.key}]"]
        if self.shape_a != self.shape_b:
            lines.append(f"  shape {self.shape_a} in {a_name} but {self.shape_b} in {b_name}")
            return "\n".join(lines)
        lines += [
            f"  shape {self.shape_a} {self.entry['dtype']}: {self.beyond} of {self.numel} elements beyond tolerance",
            f"  max |a-b| = {self.max_abs:.3e}   max |a-b|/|a| = {self.max_rel:.3e}   rms(a) = {self.rms:.3e}",
            "  worst elements:",
            f"    {'index':<18} {'a':>14} {'b':>14} {'|a-b|':>10}",
        ]
        lines += [f"    {str(i):<18} {x:>14.7g} {y:>14.7g} {d:>10.3e}" for i, x, y, d in self.worst]
        return "\n".join(lines)


@dataclasses.dataclass
class Comparison:
    a: str
    b: str
    rtol: float
    atol: float
    stol: float
    index_a: dict
    index_b: dict
    checked: int = 0
    diffs: list = dataclasses.field(default_factory=list)  # TensorDiff, in run a's execution order
    largest: tuple = (0.0, None)  # (largest |a-b| among agreeing tensors, its key)

    @property
    def agree(self) -> bool:
        return not self.diffs

    @property
    def first(self) -> TensorDiff | None:
        return self.diffs[0] if self.diffs else None

    def report(self) -> str:
        ranks = lambda i: f"{i.get('world_size', 1)} rank(s)"  # noqa: E731
        lines = [
            f"a = {self.a} ({ranks(self.index_a)}), b = {self.b} ({ranks(self.index_b)}): {self.checked} tensors "
            f"over {self.index_a['steps']} step(s), tolerance |a-b| <= {self.atol:g} + {self.rtol:g}*|a| + {self.stol:g}*rms(a)"
        ]
        if self.agree:
            value, key = self.largest
            lines.append(f"OK: the runs agree; largest |a-b| = {value:.3e}" + (f" ({key})" if key else ""))
            return "\n".join(lines)
        lines += ["FIRST DIFFERENCE: " + self.first.details(self.a, self.b)]
        rest = self.diffs[1:]
        if rest:
            lines.append(f"then {len(rest)} more tensor(s) beyond tolerance, in execution order:")
            lines.append(f"  {'step':>4}  {'tensor':<44} {'max|a-b|':>10} {'max rel':>10} {'beyond':>12}")
            for d in rest[:TABLE_ROWS]:
                amount = "shape" if d.shape_a != d.shape_b else f"{d.beyond}/{d.numel}"
                lines.append(f"  {d.step:>4}  {d.key:<44} {d.max_abs:>10.2e} {d.max_rel:>10.2e} {amount:>12}")
            if len(rest) > TABLE_ROWS:
                lines.append(f"  ... and {len(rest) - TABLE_ROWS} more")
        lines.append(f"FAIL: {len(self.diffs)} of {self.checked} tensors differ; the runs part at step {self.first.step}, {self.first.where}")
        return "\n".join(lines)


def _rms(a: torch.Tensor) -> float:
    """Root mean square of the finite elements of ``a`` (0 for none)."""
    finite = a[a.isfinite()]
    return finite.pow(2).mean().sqrt().item() if finite.numel() else 0.0


def _diff(entry: dict, x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float, stol: float) -> TensorDiff | None:
    d = TensorDiff(entry["step"], entry["key"], entry, tuple(x.shape), tuple(y.shape))
    if x.shape != y.shape:
        return d
    a, b = x.double(), y.double()
    gap = (a - b).abs()
    d.rms = _rms(a) if stol else 0.0
    ok = (a == b) | (gap <= atol + rtol * a.abs() + stol * d.rms) | (a.isnan() & b.isnan())
    finite_gap = torch.where(ok, torch.zeros_like(gap), gap.nan_to_num(nan=float("inf")))
    d.max_abs = gap.nan_to_num(nan=float("inf")).max().item() if gap.numel() else 0.0
    rel = gap / a.abs()
    d.max_rel = rel.nan_to_num(nan=0.0)[~ok].max().item() if (~ok).any() else 0.0
    d.beyond = int((~ok).sum())
    if d.beyond == 0:
        return None
    worst = finite_gap.flatten().topk(min(WORST_SHOWN, d.beyond)).indices
    for flat in worst.tolist():
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
        d.worst.append((idx, x.flatten()[flat].item(), y.flatten()[flat].item(), gap.flatten()[flat].item()))
    return d


def _load_step(directory: str, step: int) -> dict:
    path = os.path.join(directory, f"step{step}.pt")
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise RecordMismatch(f"{path} is missing but {directory}/{INDEX} lists step {step}; was the record copied partly?") from None


def compare_runs(
    a: str, b: str, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL, stol: float = DEFAULT_STOL
) -> Comparison:
    """Compare record ``a`` with record ``b`` (``a`` is the reference of the relative tolerances):
    an element agrees when ``|a - b| <= atol + rtol * |a| + stol * rms(a)``, ``rms(a)`` the root
    mean square of its whole tensor in run ``a``."""
    ia, ib = load_index(a), load_index(b)
    _check_comparable(a, ia, b, ib)
    result = Comparison(a, b, rtol, atol, stol, ia, ib)
    for step in range(ia["steps"]):
        ta, tb = _load_step(a, step), _load_step(b, step)
        for entry in (e for e in ia["entries"] if e["step"] == step):
            x, y = ta[entry["key"]], tb[entry["key"]]
            result.checked += 1
            d = _diff(entry, x, y, rtol, atol, stol)
            if d is not None:
                result.diffs.append(d)
            elif x.numel():
                gap = (x.double() - y.double()).abs().nan_to_num(nan=0.0).max().item()
                if gap > result.largest[0]:
                    result.largest = (gap, f"step {step} {entry['key']}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vescale.debug.compare a/ b/``: exit 0 when the runs agree, 1 when not, 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m vescale.debug.compare",
        description="Name the first tensor, in execution order, where two records of vescale.debug.record differ.",
    )
    parser.add_argument("a", help="record directory of the reference run (e.g. single device)")
    parser.add_argument("b", help="record directory of the run to check")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help=f"relative tolerance, of |a| (default {DEFAULT_RTOL:g})")
    parser.add_argument("--atol", type=float, default=DEFAULT_ATOL, help=f"absolute tolerance (default {DEFAULT_ATOL:g})")
    parser.add_argument(
        "--stol", type=float, default=DEFAULT_STOL,
        help=f"tolerance of the tensor's scale: a fraction of the root mean square of a's whole tensor (default {DEFAULT_STOL:g})",
    )
    args = parser.parse_args(argv)
    try:
        result = compare_runs(args.a, args.b, args.rtol, args.atol, args.stol)
    except RecordMismatch as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.agree else 1
