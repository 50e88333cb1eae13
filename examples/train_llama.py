"""Train a tiny LLaMA for a few AdamW steps on one device or on a DP x TP mesh; write the losses to JSON.

The model is the same unchanged single-device model in both cases; only the plan differs:

    python examples/train_llama.py --out single.json
    torchrun --standalone --nproc-per-node 4 examples/train_llama.py --dp 2 --tp 2 --out dist.json
    python examples/compare_losses.py single.json dist.json

``--local-batches``: each data-parallel rank loads only its rows of every global batch
(``vescale.data.DataLoader`` keyed by the DP coordinate, ``llama_plan(..., local_inputs=True)``)
instead of every rank loading the whole batch; the losses are the global-batch run's, bit for bit:

    torchrun --standalone --nproc-per-node 4 examples/train_llama.py --dp 2 --tp 2 --local-batches --out local.json

Every rank builds the full model from the same seed, exactly as the single-device run does, and
``vescale.parallelize`` then keeps each rank's part: both runs start from identical weights and
see identical global batches, so with single-device semantics their losses agree step by step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import vescale
import vescale.debug
import vescale.random
from vescale.zoo.data import synthetic_batches
from vescale.zoo.hf import tiny_hf_llama, tiny_llama

# PyTorch warns, once per rank, that a redistribution over two mesh dims takes two collectives
# (ZeRO-3 + vocabulary-parallel embedding); fusing them is vescale.comm's job, and the warning is noise here.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the per-step losses (written by rank 0)")
    parser.add_argument("--model", choices=["llama", "hf-llama"], default="llama",
                        help="vescale.zoo's LLaMA or HuggingFace transformers' LlamaForCausalLM (same sizes)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (mesh dimension 'DP')")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mesh dimension 'TP')")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false",
                        help="keep activations between TP regions replicated instead of sharded on sequence")
    parser.add_argument("--no-zero3", dest="zero3", action="store_false",
                        help="keep parameters replicated over DP instead of sharded at rest (ZeRO-3)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch size")
    parser.add_argument("--seq-len", type=int, default=32)
    # 3e-3 lowers the loss visibly in 10 steps; at 1e-2, AdamW amplifies float32 rounding so much that
    # a 1-ulp change of the initial weights alone moves the 10th loss by ~1.5e-5 (measured).
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="attention and residual dropout probability (HF's model has attention dropout only)")
    parser.add_argument("--seed", type=int, default=0, help="seeds weight initialisation and data")
    parser.add_argument("--local-batches", action="store_true",
                        help="each DP rank loads only its share of every global batch (vescale.data) instead of the whole batch")
    parser.add_argument("--record", metavar="DIR",
                        help="record the first 2 steps' module outputs, parameters and gradients (global tensors) "
                             "into DIR with vescale.debug.record; compare two runs with python -m vescale.debug.compare")
    return parser.parse_args(argv)


def check_launch(args) -> None:
    """Fail early, with the command to use, when the process count does not fit --dp x --tp."""
    degree = args.dp * args.tp
    launched = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun sets it; plain python does not
    if launched != degree:
        how = (
            "run it with plain python (or torchrun --nproc-per-node 1)"
            if degree == 1
            else f"run it with torchrun --standalone --nproc-per-node {degree}"
        )
        raise SystemExit(
            f"--dp {args.dp} --tp {args.tp} needs {degree} process(es) but this launch has {launched}; {how}"
        )


def build_model(args) -> torch.nn.Module:
    torch.manual_seed(args.seed)  # same weights on every rank and in the single-device run
    if args.model == "hf-llama":
        return tiny_hf_llama(attention_dropout=args.dropout)
    return tiny_llama(attention_dropout=args.dropout, hidden_dropout=args.dropout)


def as_float(loss: torch.Tensor) -> float:
    """The global loss as a Python float, whether the model returned a plain tensor or a DTensor."""
    if isinstance(loss, DTensor):
        loss = loss.full_tensor()
    return loss.item()


def data_loader(args, vocab_size: int, mesh) -> vescale.data.DataLoader:
    """The synthetic global batches as one dataset, read in order: global batch i is rows
    i*B .. (i+1)*B. With ``--local-batches`` each rank gets its DP share of each (mesh given),
    otherwise the whole batch (mesh None)."""
    batches = synthetic_batches(args.steps, args.batch_size, args.seq_len, vocab_size, seed=args.seed)
    dataset = torch.utils.data.TensorDataset(*(torch.cat(column) for column in zip(*batches)))
    return vescale.data.DataLoader(dataset, args.batch_size, mesh if args.local_batches else None, dims="DP")


def train(model, optimizer, progress) -> list[float]:
    losses = []
    for input_ids, labels in progress:
        loss = model(input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(as_float(loss))
        progress.set_postfix(loss=f"{losses[-1]:.6f}", refresh=False)
    return losses


@record  # under torchrun: the failing rank's traceback is shown in the launcher's summary
def main(argv=None) -> None:
    args = parse_args(argv)
    check_launch(args)
    distributed = args.dp * args.tp > 1
    mesh = vescale.init_mesh((args.dp, args.tp), ("DP", "TP")) if distributed else None
    # Both runs seed vescale's generator: dropout then draws the same numbers on one device
    # (inside `consistent()`, below) as on any mesh, where parallelize routes it to vescale.
    vescale.manual_seed(args.seed)
    model = build_model(args)
    if distributed:
        plan = vescale.zoo.llama_plan(mesh, sequence_parallel=args.sequence_parallel, zero3=args.zero3,
                                      local_inputs=args.local_batches)
        model = vescale.parallelize(model, plan, mesh)
    rank = dist.get_rank() if distributed else 0
    mode = (
        f"DP={args.dp} x TP={args.tp} (sequence parallel {'on' if args.sequence_parallel else 'off'}, "
        f"ZeRO-3 {'on' if args.zero3 else 'off'}{', per-rank batches' if args.local_batches else ''})"
        if distributed
        else "single device"
    )

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab_size = model.config.vocab_size
    progress = tqdm(data_loader(args, vocab_size, mesh), desc=f"{args.model}, {mode}", unit="step", disable=rank != 0)
    single_device_rng = vescale.random.consistent() if not distributed else contextlib.nullcontext()
    recording = (
        vescale.debug.record(model, args.record, steps=min(2, args.steps), overwrite=True)
        if args.record else contextlib.nullcontext()
    )
    with single_device_rng, recording:
        losses = train(model, optimizer, progress)

    if rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"mode": mode, "args": vars(args), "losses": losses}, f, indent=1)
        print(f"wrote {len(losses)} losses to {args.out}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
