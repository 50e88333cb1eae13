"""Fault-tolerant training: checkpoint every step, resume from the latest checkpoint after a restart.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/resume_training.py \
        --ckpt /tmp/ckpt --out losses.json --kill-rank 1 --kill-at 3

Trains the zoo's tiny LLaMA (dropout on) on a DP x TP mesh, saving a checkpoint after every step
(``keep_last=2``). When a worker dies (``--kill-at`` SIGKILLs rank ``--kill-rank`` at that step,
first attempt only), torchrun restarts all workers; each calls ``vescale.init_mesh`` again (which
joins the new rendezvous), loads the latest checkpoint (model, optimiser, RNG, step) and carries on.
Rank 0 writes the loss of every step to ``--out``; they equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor

import vescale
from vescale import checkpoint
from vescale.zoo import llama_plan, synthetic_batches, tiny_llama

logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint folder (shared by all ranks)")
    parser.add_argument("--out", required=True, help="JSON file for the per-step losses (rank 0)")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=None, help="step at which --kill-rank SIGKILLs itself")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds")
    return parser.parse_args(argv)


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    mesh = vescale.init_mesh((args.dp, args.tp), ("DP", "TP"), timeout=args.timeout)
    torch.manual_seed(0)
    model = tiny_llama(attention_dropout=0.1, hidden_dropout=0.1)
    vescale.manual_seed(0)
    vescale.parallelize(model, llama_plan(mesh, model.config), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = synthetic_batches(args.steps, 4, 16, 128, seed=1)

    start, losses = 0, []
    if checkpoint.latest(args.ckpt) is not None:
        extras = checkpoint.load(args.ckpt, model, optimizer)
        start, losses = extras["step"], extras["losses"]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(start, args.steps):
        if step == args.kill_at and attempt == 0 and dist.get_rank() == args.kill_rank:
            os.kill(os.getpid(), signal.SIGKILL)  # a hard crash: no exception, no cleanup
        input_ids, labels = batches[step]
        loss = model(input_ids=input_ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
        # The losses so far travel in the checkpoint, so the resumed run reports the whole curve.
        checkpoint.save(args.ckpt, model, optimizer, step=step + 1, keep_last=2, losses=losses)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "restarts": attempt}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
