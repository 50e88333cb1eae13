"""Train a HuggingFace causal LM on your own text, on one device or on a DP x TP mesh: the end-to-end recipe.

    torchrun --standalone --nproc-per-node 4 examples/train.py --model llama --text notes.txt \\
        --dp 2 --tp 2 --zero3 --sp --steps 200 --out runs/llama
    python examples/train.py --config my_config.json --text notes.txt --steps 200 --out runs/one

The model is ``transformers.AutoModelForCausalLM.from_config``, unchanged: from a JSON config in HF's
format (``--config``: any checkpoint's ``config.json``, or one written by hand; nothing is downloaded)
or from a zoo name (``--model llama | gpt2 | mixtral | qwen3_moe``: vescale.zoo's tiny configs with a
256-token vocabulary). The text is read as bytes, one token per byte (no tokenizer to download; a
config's vocabulary must hold the 256 byte values, larger ones leave the ids above 255 unused), cut
into rows of ``--seq-len`` tokens and shuffled each epoch. The plan follows the model type
(``llama_plan``, ``gpt2_plan``, ``moe_plan``; DP and ZeRO-3 alone for other types) and the flags.

Every rank builds the model on the meta device and ``vescale.parallelize`` allocates only its shards,
filled with the values the single-device run of this script starts from (``vescale.init``): the run
without ``--dp`` / ``--tp`` is the reference of every mesh, dropout masks included. Each DP rank loads
only its rows of each global batch (``vescale.data.DataLoader``; the plans' ``local_inputs=True``).

Written to ``--out`` (rank 0):

    checkpoints/step_N/  every --ckpt-every steps and at the end: model, optimiser, RNG, data position,
                         LR schedule and the losses so far (vescale.checkpoint). Rerunning the command
                         resumes from the latest; a larger --steps continues a finished run.
    losses.json          the per-step losses, tokens/s, the settings and rank 0's parameter shapes
    loss.png             the loss curve (needs matplotlib)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import vescale
import vescale.random
from vescale import checkpoint
from vescale.zoo import (gpt2_plan, llama_plan, moe_plan, tiny_hf_gpt2_config, tiny_hf_llama_config,
                         tiny_hf_mixtral_config, tiny_hf_qwen3_moe_config)
from vescale.zoo.hf import _transformers

# PyTorch warns, once per rank, that a redistribution over two mesh dims takes two collectives
# (ZeRO-3 + vocabulary-parallel embedding); fusing them is vescale.comm's job, and the warning is noise here.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
# DCP warns that a single-device run (no process group) saves from one process, which is the intent.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

BYTE_VOCAB = 256  # one token per byte value
ZOO_CONFIGS = {
    "llama": tiny_hf_llama_config,
    "gpt2": tiny_hf_gpt2_config,
    "mixtral": tiny_hf_mixtral_config,
    "qwen3_moe": tiny_hf_qwen3_moe_config,
}
MOE_TYPES = ("mixtral", "qwen3_moe")
# What a checkpoint's run must share with this one to be continued by it (the mesh and plan may differ).
RUN_KEYS = ("model", "config", "text_sha256", "seq_len", "batch_size", "lr", "warmup", "weight_decay",
            "grad_clip", "seed", "bf16")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Run `python examples/train.py --help` for the flags; see the module doc for the outputs.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=sorted(ZOO_CONFIGS), help="a vescale.zoo tiny HF model (256-token vocabulary)")
    source.add_argument("--config", metavar="JSON", help="an HF config file (AutoConfig format, with model_type)")
    parser.add_argument("--text", required=True, help="a local text file (any bytes): the training data")
    parser.add_argument("--out", required=True, help="output folder: checkpoints, losses.json, loss.png")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel degree (mesh dim 'DP')")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mesh dim 'TP')")
    parser.add_argument("--zero3", action="store_true", help="ZeRO-3: parameters and optimiser state sharded over DP at rest")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism between TP blocks (llama, mixtral, qwen3_moe)")
    parser.add_argument("--static", action="store_true", help="Static Eager mode: steps after the first run on local tensors")
    parser.add_argument("--bf16", action="store_true", help="mixed precision: bf16 compute, fp32 master weights and reduction")
    parser.add_argument("--steps", type=int, default=100, help="train until this many optimiser steps in all (resumed runs included)")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch size in rows (split over DP)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per row")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate after warm-up")
    parser.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warm-up, then constant")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm to this (0: off)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights, dropout and the data order")
    parser.add_argument("--ckpt-every", type=int, default=50, help="save a checkpoint every N steps and at the end (0: never)")
    parser.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
    return parser.parse_args(argv)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def check_flags(args, world: int) -> None:
    """Refuse flag combinations that cannot run, naming the flag and the fix, before any collective."""
    def fail(message):
        raise SystemExit(f"train.py: {message}")

    for name in ("dp", "tp", "steps", "batch_size", "seq_len"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    for name in ("warmup", "ckpt_every", "weight_decay", "grad_clip"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if args.keep_last < 1:
        fail(f"--keep-last must be at least 1, got {args.keep_last}")
    degree = args.dp * args.tp
    if degree != world:
        how = ("run it with plain python (or torchrun --nproc-per-node 1)" if degree == 1
               else f"run it with torchrun --standalone --nproc-per-node {degree}")
        fail(f"--dp {args.dp} x --tp {args.tp} = {degree} rank(s), but this launch has {world}: {how}, "
             f"or choose --dp and --tp whose product is {world}")
    if args.zero3 and args.dp == 1:
        fail("--zero3 shards parameters over the data-parallel ranks: it needs --dp 2 or more")
    if args.sp and args.tp == 1:
        fail("--sp splits the sequence over the tensor-parallel ranks: it needs --tp 2 or more")
    if args.static and degree == 1:
        fail("--static is a mode of the parallel runtime; a single-device run is plain PyTorch already: drop --static")
    if args.batch_size % args.dp:
        fail(f"--batch-size {args.batch_size} does not split into --dp {args.dp} equal shares: use a multiple of {args.dp}")


def model_config(args):
    """The HF config: a zoo name's tiny config with the byte vocabulary, or the file's, checked against the data."""
    if args.model:
        config = ZOO_CONFIGS[args.model](vocab_size=BYTE_VOCAB)
        # room for --seq-len positions (GPT-2's config maps this name to n_positions)
        config.max_position_embeddings = max(config.max_position_embeddings, args.seq_len)
    else:
        transformers = _transformers()
        try:
            config = transformers.AutoConfig.from_pretrained(args.config)
        except (OSError, ValueError, json.JSONDecodeError) as e:
            raise SystemExit(f"train.py: --config {args.config}: {e}") from None
        if config.vocab_size < BYTE_VOCAB:
            raise SystemExit(f"train.py: --config {args.config} has vocab_size {config.vocab_size}, but the byte-level "
                             f"tokenizer needs {BYTE_VOCAB} ids: set \"vocab_size\": {BYTE_VOCAB} (or more) in the file")
        positions = getattr(config, "max_position_embeddings", None)
        if positions is not None and args.seq_len > positions:
            raise SystemExit(f"train.py: --seq-len {args.seq_len} is longer than the config's max_position_embeddings "
                             f"{positions}: lower --seq-len or raise it in {args.config}")
    config.use_cache = False  # training needs no KV cache
    return config


def plan_for(config, mesh, args):
    """The zoo plan for the model type, on the mesh dims the flags made, each DP rank passing its own rows."""
    kind = config.model_type
    options = dict(zero3=args.zero3, local_inputs=True)
    if kind == "llama":
        return llama_plan(mesh, config, sequence_parallel=args.sp, **options)
    if kind in MOE_TYPES:
        return moe_plan(mesh, config, sequence_parallel=args.sp, **options)
    if kind == "gpt2":
        if args.sp:
            raise SystemExit("train.py: gpt2_plan has no sequence parallelism: drop --sp for GPT-2")
        return gpt2_plan(mesh, config, **options)
    if args.tp > 1 or args.sp:
        raise SystemExit(
            f"train.py: no tensor-parallel plan for model_type {kind!r} (plans exist for llama, gpt2, mixtral, "
            f"qwen3_moe); use --tp 1 (data parallelism and ZeRO-3 work for any model) or write a plan (docs/plan.md)"
        )
    # DP and ZeRO-3 name no module: llama_plan without its TP dim splits the batch and every weight.
    return llama_plan(mesh, config, tp=None, **options)


def text_rows(path: str, seq_len: int, batch_size: int) -> tuple[torch.Tensor, str]:
    """The file's bytes as rows of ``seq_len`` token ids (int64; a trailing part row is dropped), and its sha256."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SystemExit(f"train.py: --text {path}: {e.strerror}") from None
    rows = len(data) // seq_len
    if rows < batch_size:
        raise SystemExit(
            f"train.py: --text {path} has {len(data)} bytes, fewer than one global batch of --batch-size {batch_size} "
            f"x --seq-len {seq_len} = {batch_size * seq_len} bytes: give more text or lower those flags"
        )
    ids = torch.frombuffer(bytearray(data[: rows * seq_len]), dtype=torch.uint8).long()
    return ids.view(rows, seq_len), hashlib.sha256(data).hexdigest()


def check_same_text(text_sha256: str, path: str, mesh) -> None:
    """Every rank read the same bytes (a file edited while the ranks start, or a different file on
    another node, would feed TP peers different rows): two one-number all-reduces, at any world size."""
    if mesh is None:
        return
    digest = torch.tensor([int(text_sha256[:15], 16)], device=mesh.device_type)  # 60 bits of the hash
    low, high = digest.clone(), digest.clone()
    dist.all_reduce(low, dist.ReduceOp.MIN)
    dist.all_reduce(high, dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise SystemExit(f"train.py: the ranks read different contents from --text {path}: it changed while the run "
                         "started, or it differs between nodes; give every rank the same file and start again")


def build_model(config, mesh, args):
    """The unchanged HF model, parallelised on ``mesh``; on one device built under vescale's RNG.

    Both start from the same values: deferred init fills each rank's shards with what the
    single-device build draws from ``vescale.manual_seed(seed)`` under ``vescale.random.consistent()``."""
    transformers = _transformers()
    vescale.manual_seed(args.seed)
    # --bf16: bf16 compute, fp32 masters and gradient reduction; one device applies the same policy,
    # so the single-device run is the reference for the mesh's in mixed precision too.
    policy = vescale.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    if mesh is None:
        with vescale.random.consistent():
            model = transformers.AutoModelForCausalLM.from_config(config)
        model = model.to("cuda" if torch.cuda.is_available() else "cpu")
        return vescale.apply_mixed_precision(model, policy) if policy is not None else model
    with torch.device("meta"):  # no memory: parallelize allocates this rank's shards only
        model = transformers.AutoModelForCausalLM.from_config(config)
    return vescale.parallelize(model, plan_for(config, mesh, args), mesh, mode="static" if args.static else "eager",
                               mixed_precision=policy)


def parameter_shapes(model) -> dict[str, dict[str, list[int]]]:
    """Each parameter's global shape and this rank's local one (what the plan really split)."""
    shapes = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        shapes[name] = {"global": list(p.shape), "local": list(local.shape)}
    return shapes


def as_float(loss: torch.Tensor) -> float:
    """The global loss as a Python float, whether the model returned a plain tensor or a DTensor."""
    return (loss.full_tensor() if isinstance(loss, DTensor) else loss).item()


def run_settings(args, config, text_sha256: str) -> dict:
    """What a resumed run must share with the saved one (RUN_KEYS)."""
    settings = {k: v for k, v in vars(args).items() if k in RUN_KEYS}
    settings["config"] = {k: v for k, v in config.to_diff_dict().items() if k not in ("_name_or_path", "transformers_version")}
    settings["model"] = args.model or config.model_type
    settings["text_sha256"] = text_sha256
    return settings


def check_same_run(saved: dict, now: dict, folder: Path) -> None:
    differ = [k for k in RUN_KEYS if saved.get(k) != now.get(k)]
    if differ:
        shown = "; ".join(f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in differ if k != "config")
        if "config" in differ:
            keys = sorted(k for k in set(saved["config"]) | set(now["config"]) if saved["config"].get(k) != now["config"].get(k))
            shown = "; ".join(filter(None, [shown, f"model config differs in {keys}"]))
        raise SystemExit(
            f"train.py: {folder} holds a checkpoint of another run ({shown}). Use the saved run's settings to continue "
            f"it (the mesh flags --dp/--tp/--zero3/--sp/--static may change), or another --out for a new run"
        )


def warmup_schedule(optimizer, warmup: int):
    """Linear warm-up over ``warmup`` steps, then the constant learning rate: independent of --steps,
    so a finished run continues with a larger --steps exactly as one longer run would."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)


def mode_of(args) -> str:
    """The mesh and plan options in words, e.g. ``DP=2 x TP=2 (SP, ZeRO-3)``."""
    mesh = " x ".join(f"{n}={s}" for n, s in (("DP", args.dp), ("TP", args.tp)) if s > 1) or "single device"
    extras = [name for name, on in (("SP", args.sp), ("ZeRO-3", args.zero3), ("Static Eager", args.static)) if on]
    return mesh + (f" ({', '.join(extras)})" if extras else "")


def describe(args, config, model, rows: torch.Tensor, loader) -> str:
    total = sum(p.numel() for p in model.parameters())
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    return (
        f"model: {args.model or args.config} ({type(model).__name__}), {total / 1e6:.2f}M parameters; "
        f"{mode_of(args)}; rank 0 holds {local / 1e6:.2f}M "
        f"({100 * local / total:.0f}%)\ndata: {args.text}, {rows.numel():,} tokens = {len(rows)} rows of {args.seq_len}, "
        f"{len(loader)} global batches of {args.batch_size} per epoch"
    )


def plot_losses(path: Path, losses: list[float], resumed_at: list[int], title: str) -> None:
    """The loss curve as a PNG (headless matplotlib); a dotted line where a run resumed."""
    try:
        import matplotlib
    except ImportError:
        print(f"no loss plot: matplotlib is not installed (pip install matplotlib); the losses are in {path.parent / 'losses.json'}")
        return
    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, "-", lw=1.2)
    for step in resumed_at:
        ax.axvline(step + 0.5, color="grey", linestyle=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


@record  # under torchrun: the failing rank's traceback is shown in the launcher's summary
def main(argv=None) -> None:
    args = parse_args(argv)
    check_flags(args, world_size())
    dims = [(name, size) for name, size in (("DP", args.dp), ("TP", args.tp)) if size > 1]
    owns_group = not dist.is_initialized()  # a caller's process group (a test harness's) is left to it
    mesh = vescale.init_mesh([s for _, s in dims], [n for n, _ in dims]) if dims else None
    rank = dist.get_rank() if mesh is not None else 0
    out, ckpt = Path(args.out), Path(args.out) / "checkpoints"

    config = model_config(args)
    rows, text_sha256 = text_rows(args.text, args.seq_len, args.batch_size)
    check_same_text(text_sha256, args.text, mesh)
    model = build_model(config, mesh, args)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    schedule = warmup_schedule(optimizer, args.warmup)
    # This DP rank's rows of each global batch (the whole batch without DP), reshuffled each epoch.
    loader = vescale.data.DataLoader(torch.utils.data.TensorDataset(rows), args.batch_size,
                                     mesh if args.dp > 1 else None, dims="DP", shuffle=True, seed=args.seed)
    settings = run_settings(args, config, text_sha256)

    start, losses, resumed_at, epoch = 0, [], [], 0
    if checkpoint.latest(ckpt) is not None:
        extras = checkpoint.load(ckpt, model, optimizer)
        check_same_run(extras["run"], settings, ckpt)
        loader.load_state_dict(extras["data"])
        schedule.load_state_dict(extras["schedule"])
        start, losses, resumed_at, epoch = extras["step"], extras["losses"], extras["resumed_at"] + [extras["step"]], extras["data"]["epoch"]
    if rank == 0:
        print(describe(args, config, model, rows, loader))
        if start:
            print(f"resumed from {checkpoint.latest(ckpt)} at step {start}")

    def save(step: int) -> None:
        checkpoint.save(ckpt, model, optimizer, step=step, keep_last=args.keep_last, data=loader.state_dict(),
                        schedule=schedule.state_dict(), losses=losses, resumed_at=resumed_at, run=settings)

    tokens_per_step = args.batch_size * args.seq_len
    rates = []
    progress = tqdm(total=args.steps, initial=start, unit="step", disable=rank != 0, dynamic_ncols=True)
    step = start
    while step < args.steps:
        loader.set_epoch(epoch)
        for (input_ids,) in loader:
            began = time.perf_counter()
            input_ids = input_ids.to(device)
            # One device: the model's random ops (dropout) draw from vescale's generator, as on a mesh.
            # Only the model's step: torch's DataLoader draws a seed for each new iterator, which
            # would move that generator on one device and not on a mesh.
            with vescale.random.consistent() if mesh is None else contextlib.nullcontext():
                loss = model(input_ids=input_ids, labels=input_ids).loss  # HF shifts the labels
                loss.backward()
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            losses.append(as_float(loss))
            rates.append(tokens_per_step / (time.perf_counter() - began))
            step += 1
            progress.update()
            progress.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{rates[-1]:,.0f}", epoch=epoch, refresh=False)
            if args.ckpt_every and (step % args.ckpt_every == 0 or step == args.steps):
                save(step)
            if step == args.steps:
                break
        else:
            epoch += 1
    progress.close()

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        # The first step of a run builds caches (and records, in Static Eager mode): leave it out of the rate.
        steady = rates[1:] or rates
        summary = {
            "mode": mode_of(args),  # examples/compare_losses.py shows it
            "settings": settings | {"dp": args.dp, "tp": args.tp, "zero3": args.zero3, "sp": args.sp, "static": args.static},
            "losses": losses, "resumed_at": resumed_at, "steps_this_run": len(rates),
            "tokens_per_s": statistics.median(steady) if steady else None,
            "parameters": parameter_shapes(model),
        }
        (out / "losses.json").write_text(json.dumps(summary, indent=1))
        if rates:
            print(f"trained steps {start + 1}-{step}: loss {losses[start]:.4f} -> {losses[-1]:.4f}, "
                  f"median {summary['tokens_per_s']:,.0f} tokens/s")
        print(f"wrote {out / 'losses.json'}")
        if losses and not math.isnan(losses[-1]):
            plot_losses(out / "loss.png", losses, resumed_at, f"{settings['model']} on {args.text}, {mode_of(args)}")
    if mesh is not None and owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
