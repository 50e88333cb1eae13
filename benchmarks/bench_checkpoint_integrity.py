"""What checkpoint checksums cost: CRC-32 throughput, save with and without checksums, load with and
without verification, interleaved in one run.

    .venv/bin/python benchmarks/bench_checkpoint_integrity.py [--mb 300] [--repeats 5] [--dir /tmp/x]

One process (no process group): a stack of linear layers holding ``--mb`` MB of float32 weights
and AdamW's two moments (so the checkpoint is about 3x that), saved once by vescale (which records
the checksums), then loaded ``--repeats`` times with ``verify=True`` and ``verify=False`` in the
order off, on, on, off, ...; likewise DCP's plain ``FileSystemWriter`` against vescale's
``ChecksumWriter`` (the CRC computed as the bytes are written). The files stay in the page cache
between repeats (what a restart on the same machine sees; a cold read adds the disk's time to both
arms, the verification's read then warms the cache for DCP's). Prints medians (min-max) and ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from vescale import checkpoint
from vescale.checkpoint import integrity


def _model(mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 2048
    layers = max(1, mb * 2**20 // (4 * width * width))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, width)).sum().backward()
    opt.step()
    return model, opt


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.3f} s ({min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=300, help="MB of weights (the checkpoint is ~3x: AdamW's moments)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.dir or tempfile.mkdtemp(prefix="vescale-integrity-"))

    buffer = os.urandom(64 << 20)
    start = time.perf_counter()
    for _ in range(4):
        zlib.crc32(buffer)
    crc_mbs = 4 * 64 / (time.perf_counter() - start)

    model, opt = _model(args.mb)
    folder = checkpoint.save(root / "ckpt", model, opt, step=1)
    size = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
    start = time.perf_counter()
    files = integrity.read_manifest(folder)
    assert not integrity.verify(folder, files)
    verify_s = time.perf_counter() - start

    loads = {False: [], True: []}
    saves = {False: [], True: []}
    for i in range(2 * args.repeats):
        on = (i % 2 == 1) != (i // 2 % 2 == 1)  # off, on, on, off, ...
        start = time.perf_counter()
        checkpoint.load(root / "ckpt", model, opt, verify=on)
        loads[on].append(time.perf_counter() - start)
        target = root / f"save_{i}"
        writer = integrity.ChecksumWriter(target) if on else dcp.FileSystemWriter(target)
        state = {"model": model.state_dict()}
        start = time.perf_counter()
        dcp.save(state, storage_writer=writer, no_dist=True)
        saves[on].append(time.perf_counter() - start)
        shutil.rmtree(target)
    print(f"## checkpoint of {size:.0f} MB ({args.mb} MB of weights + AdamW), one process, page cache warm")
    print(f"zlib.crc32: {crc_mbs:.0f} MB/s; verifying every file alone: {verify_s:.3f} s ({size / verify_s:.0f} MB/s)")
    print(f"load  verify=False {_fmt(loads[False])}   verify=True {_fmt(loads[True])}   "
          f"ratio {statistics.median(loads[True]) / statistics.median(loads[False]):.3f}")
    print(f"save of the weights ({args.mb} MB) FileSystemWriter {_fmt(saves[False])}   ChecksumWriter {_fmt(saves[True])}   "
          f"ratio {statistics.median(saves[True]) / statistics.median(saves[False]):.3f}")
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
