"""What one example of the differential fuzzer is, the small models it trains, and the generator.

A ``Case`` is plain data (printable, pasteable): a model (``Net``: an input stage, blocks of the ops
real models use, a norm, a head and a loss), a mesh, a plan (``vescale.VescalePlan`` statements as
tuples), batch and sequence sizes, the mode, the gradient reduction, the accumulation, the optimiser,
and the activations that must arrive split (``expect``). ``draw_case(seed)`` makes one from a seed;
``fuzz_run.py`` trains it on gloo ranks and on one device and judges the difference.

The model vocabulary (``Spec``) covers what the zoo models are made of and the ways they slice
fused projections:

* input: token ids through an ``nn.Embedding`` (optionally tied to the head) or an image through a
  ``Conv2d`` patch embedding (DiT); learned positions from ``torch.arange`` (``plan.factory``);
* blocks (pre-norm residual, LayerNorm or RMSNorm, dropout): attention (q/k/v separate or one fused
  projection sliced by ``split`` / ``chunk`` / ``x[..., a:b]`` / ``narrow``, SDPA or eager softmax,
  dropout on the probabilities), MLP (GELU, or SwiGLU with a fused gate|up), HF Mixtral's MoE block
  (router, top-k, experts), a depthwise ``Conv1d`` along the sequence;
* projections: ``nn.Linear`` or HF's ``Conv1D`` (weight transposed), with or without bias.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

__all__ = ["Spec", "Case", "Net", "build_model", "build_plan", "placement", "batches", "draw_case"]


# ----------------------------------------------------------------------------------------- the model


@dataclasses.dataclass(frozen=True)
class Spec:
    blocks: tuple[str, ...] = ("attn", "mlp")  # each: "attn", "mlp", "moe", "conv"
    dim: int = 8
    heads: int = 2
    vocab: int = 16  # tokens in; 0: an image in (Conv2d patches), a regression target out
    proj: str = "linear"  # or "conv1d" (HF's, weight (in, out))
    bias: bool = True
    fused: str = "none"  # q|k|v and gate|up as one projection sliced by: "split", "chunk", "index", "narrow"
    attn: str = "sdpa"  # or "eager"
    norm: str = "layer"  # or "rms"
    gated: bool = False  # SwiGLU MLP (gate|up) instead of GELU
    dropout: float = 0.0
    tied: bool = False
    positions: bool = False
    experts: str = "grouped_mm"  # HF's experts kernel: "grouped_mm", "batched_mm", "eager"


class Conv1DNoBias(Conv1D):
    """HF's ``Conv1D`` without its bias: the same view and matmul, no ``addmm``."""

    def __init__(self, nf: int, nx: int):
        super().__init__(nf, nx)
        del self.bias

    def forward(self, x):
        return (x.view(-1, x.size(-1)) @ self.weight).view(*x.size()[:-1], self.nf)


def _proj(spec: Spec, n_in: int, n_out: int, bias: bool | None = None) -> nn.Module:
    bias = spec.bias if bias is None else bias
    if spec.proj == "conv1d":
        return Conv1D(n_out, n_in) if bias else Conv1DNoBias(n_out, n_in)
    return nn.Linear(n_in, n_out, bias=bias)


def sections(t: torch.Tensor, size: int, n: int, how: str) -> tuple[torch.Tensor, ...]:
    """The ``n`` sections of ``size`` features along the last dim, sliced the way models do it
    (sizes from the config, as HF's GPT-2 ``split`` and Phi-3's ``qkv[..., :pos]`` use them)."""
    if how == "split":
        return t.split(size, dim=-1)
    if how == "chunk":
        return t.chunk(n, dim=-1)
    if how == "index":
        return tuple(t[..., i * size:(i + 1) * size] for i in range(n))
    return tuple(t.narrow(-1, i * size, size) for i in range(n))


class Core(nn.Module):
    """softmax(q k^T / sqrt(d)) v, causal, dropout on the probabilities: SDPA or written out."""

    def __init__(self, spec: Spec):
        super().__init__()
        self.sdpa, self.p = spec.attn == "sdpa", spec.dropout

    def forward(self, q, k, v):
        p = self.p if self.training else 0.0
        if self.sdpa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        probs = F.dropout(scores.masked_fill(~causal, float("-inf")).softmax(-1), p, self.training)
        return probs @ v


class Attention(nn.Module):
    def __init__(self, spec: Spec):
        super().__init__()
        self.dim, self.head_dim, self.fused = spec.dim, spec.dim // spec.heads, spec.fused
        if self.fused == "none":
            self.q, self.k, self.v = (_proj(spec, spec.dim, spec.dim) for _ in range(3))
        else:
            self.qkv = _proj(spec, spec.dim, 3 * spec.dim)
        self.core = Core(spec)
        self.o = _proj(spec, spec.dim, spec.dim)

    def forward(self, x):
        if self.fused == "none":
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            q, k, v = sections(self.qkv(x), self.dim, 3, self.fused)
        shape = (*x.shape[:-1], -1, self.head_dim)  # HF's hidden_shape
        out = self.core(*(t.view(shape).transpose(1, 2) for t in (q, k, v)))
        return self.o(out.transpose(1, 2).reshape(*x.shape[:-1], -1))


class MLP(nn.Module):
    def __init__(self, spec: Spec):
        super().__init__()
        self.hidden, self.gated, self.fused = 2 * spec.dim, spec.gated, spec.fused
        if self.gated and self.fused != "none":
            self.gate_up = _proj(spec, spec.dim, 2 * self.hidden)
        else:
            self.up = _proj(spec, spec.dim, self.hidden)
            if self.gated:
                self.gate = _proj(spec, spec.dim, self.hidden)
        self.down = _proj(spec, self.hidden, spec.dim)

    def forward(self, x):
        if not self.gated:
            return self.down(F.gelu(self.up(x)))
        if self.fused != "none":
            gate, up = sections(self.gate_up(x), self.hidden, 2, self.fused)
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(F.silu(gate) * up)


def _moe(spec: Spec) -> nn.Module:
    """HF Mixtral's sparse MoE block (router, top-2 of 4 experts, fused gate|up experts)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=spec.dim, intermediate_size=2 * spec.dim, num_local_experts=4,
                           num_experts_per_tok=2, experts_implementation=spec.experts)
    return MixtralSparseMoeBlock(config)


class SeqConv(nn.Module):
    """A depthwise convolution along the sequence (Mamba's short conv, wav2vec's positions)."""

    def __init__(self, spec: Spec):
        super().__init__()
        self.conv = nn.Conv1d(spec.dim, spec.dim, 3, padding=1, groups=spec.dim, bias=spec.bias)

    def forward(self, x):
        return self.conv(x.transpose(1, 2)).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, spec: Spec, kind: str):
        super().__init__()
        self.norm = nn.LayerNorm(spec.dim) if spec.norm == "layer" else nn.RMSNorm(spec.dim)
        self.body = {"attn": Attention, "mlp": MLP, "moe": _moe, "conv": SeqConv}[kind](spec)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, h):
        return h + self.drop(self.body(self.norm(h)))


class Positions(nn.Module):
    def __init__(self, spec: Spec):
        super().__init__()
        self.table = nn.Embedding(64, spec.dim)

    def forward(self, h):
        return self.table(torch.arange(h.shape[1]))


PATCH, CHANNELS = 2, 2  # image input: (batch, CHANNELS, PATCH, PATCH * seq) -> seq tokens


class Net(nn.Module):
    def __init__(self, spec: Spec):
        super().__init__()
        self.spec = spec
        if spec.vocab:
            self.embed = nn.Embedding(spec.vocab, spec.dim)
        else:
            self.patch = nn.Conv2d(CHANNELS, spec.dim, PATCH, stride=PATCH)
        if spec.positions:
            self.pos = Positions(spec)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(Block(spec, kind) for kind in spec.blocks)
        self.norm = nn.LayerNorm(spec.dim) if spec.norm == "layer" else nn.RMSNorm(spec.dim)
        self.head = nn.Linear(spec.dim, spec.vocab or CHANNELS, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight

    def forward(self, x, labels):
        h = self.embed(x) if self.spec.vocab else self.patch(x).flatten(2).transpose(1, 2)
        if self.spec.positions:
            h = h + self.pos(h)
        h = self.drop(h)
        for block in self.blocks:
            h = block(h)
        out = self.head(self.norm(h))
        if self.spec.vocab:
            return F.cross_entropy(out.flatten(0, 1), labels.flatten())
        return F.mse_loss(out, labels)


def build_model(spec: Spec, seed: int) -> Net:
    """The model with seeded weights at scales that keep activations and losses O(1)."""
    torch.manual_seed(seed)
    model = Net(spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif p.dim() == 1:
                p.normal_(0.0, 0.1)
            else:  # (out, in) weights, experts (E, out, in) and embeddings: the last dim; convs: a filter
                fan_in = p.shape[-1] if p.dim() == 2 or "experts" in name else p[0].numel()
                p.normal_(0.0, 1.0 / math.sqrt(fan_in))
    return model


def batches(case: "Case") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global micro-batches of every step, the same on every rank (a private generator)."""
    g = torch.Generator().manual_seed(case.seed + 1)
    spec, out = case.model, []
    for _ in range(case.steps * case.accum):
        if spec.vocab:
            x = torch.randint(0, spec.vocab, (case.batch, case.seq), generator=g)
            out.append((x, torch.randint(0, spec.vocab, (case.batch, case.seq), generator=g)))
        else:
            x = torch.randn(case.batch, CHANNELS, PATCH, PATCH * case.seq, generator=g)
            out.append((x, torch.randn(case.batch, case.seq, CHANNELS, generator=g)))
    return out


# ------------------------------------------------------------------------------------------ the case


@dataclasses.dataclass(frozen=True)
class Case:
    """One example. ``plan``: statements ``(kind, path, placement, mesh_dim, phase)``; placements are
    written ``R``, ``S(d)``, ``IS(d,k)`` (``InterleavedShard``), ``P``. ``expect``: activations that
    must arrive split, ``(module path, input index or name, tensor dim, mesh dim)``. ``must_run``: a
    named error counts as a failure too (cases for features that must work)."""

    model: Spec
    mesh: tuple[tuple[str, int], ...]
    plan: tuple[tuple, ...]
    batch: int = 4
    seq: int = 4
    mode: str = "eager"
    bucket_mb: float | None = 25
    accum: int = 1
    steps: int = 2
    optim: str = "sgd"
    expect: tuple[tuple, ...] = ()
    seed: int = 0
    must_run: bool = False

    @property
    def world(self) -> int:
        return math.prod(size for _, size in self.mesh)


def placement(text: str):
    from vescale import InterleavedShard, Partial, Replicate, Shard

    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    kind, args = re.fullmatch(r"(IS|S)\((.*)\)", text).groups()
    nums = [int(a) for a in args.split(",")]
    return InterleavedShard(*nums) if kind == "IS" else Shard(nums[0])


def build_plan(case: Case):
    from vescale import INIT, RUN, VescalePlan

    plan = VescalePlan()
    for kind, path, place, mesh, phase in case.plan:
        if kind == "shard":
            plan.shard(path, placement(place), mesh=mesh, phase={"INIT": INIT, "RUN": RUN, None: None}[phase])
        elif kind in ("factory", "annotate"):
            getattr(plan, kind)(path, placement(place), mesh=mesh)
        elif kind in ("experts", "batch_local"):
            getattr(plan, kind)(path, mesh=mesh)
        elif kind == "eager":
            plan.eager(path)
        else:
            raise ValueError(f"unknown statement kind {kind!r}")
    return plan


# ------------------------------------------------------------------------------------- the generator

MESHES = {  # world size -> meshes (dims of size 1 to 4, 1-D to 3-D)
    1: [(("DP", 1),), (("TP", 1),)],
    2: [(("DP", 2),), (("TP", 2),), (("EP", 2),), (("DP", 2), ("TP", 1)), (("DP", 1), ("TP", 2)),
        (("DP", 2), ("EP", 1), ("TP", 1)), (("DP", 1), ("EP", 2))],
    4: [(("DP", 4),), (("TP", 4),), (("DP", 2), ("TP", 2)), (("DP", 1), ("TP", 4)), (("DP", 4), ("TP", 1)),
        (("DP", 2), ("EP", 2)), (("DP", 2), ("EP", 1), ("TP", 2)), (("DP", 1), ("EP", 2), ("TP", 2)),
        (("EP", 2), ("TP", 2))],
    8: [(("DP", 2), ("TP", 4)), (("DP", 4), ("TP", 2)), (("DP", 2), ("EP", 2), ("TP", 2)), (("DP", 8),),
        (("TP", 8),), (("DP", 2), ("EP", 2), ("TP", 2))],
}

_B = r"blocks\.\d+"


def _blocks_of(spec: Spec, kind: str) -> str:
    """A regex naming the blocks of one kind (``blocks\\.(0|2)``)."""
    ids = [str(i) for i, k in enumerate(spec.blocks) if k == kind]
    return rf"blocks\.({'|'.join(ids)})"


def _col(spec: Spec) -> str:  # column-parallel weight dim: nn.Linear (out, in), Conv1D (in, out)
    return "S(1)" if spec.proj == "conv1d" else "S(0)"


def _row(spec: Spec) -> str:
    return "S(0)" if spec.proj == "conv1d" else "S(1)"


def _interleaved(spec: Spec, k: int) -> str:
    return f"IS({1 if spec.proj == 'conv1d' else 0},{k})"


def draw_spec(rng: random.Random) -> Spec:
    tokens = rng.random() < 0.8
    blocks = tuple(rng.choice(["attn", "attn", "mlp", "mlp", "moe", "conv"]) for _ in range(rng.choice([1, 2, 3])))
    heads = rng.choice([1, 2, 4])
    return Spec(
        blocks=blocks, heads=heads, dim=rng.choice([8, 8, 12, 16]) if heads != 1 else 8,
        vocab=rng.choice([16, 16, 15]) if tokens else 0,
        proj=rng.choice(["linear", "conv1d"]), bias=rng.random() < 0.6,
        fused=rng.choice(["none", "split", "chunk", "index", "narrow"]),
        attn=rng.choice(["sdpa", "eager"]), norm=rng.choice(["layer", "rms"]), gated=rng.random() < 0.5,
        dropout=rng.choice([0.0, 0.1]), tied=tokens and rng.random() < 0.4, positions=rng.random() < 0.3,
        experts=rng.choice(["grouped_mm", "batched_mm", "eager"]),
    )


def _dim_sizes(case_mesh) -> dict[str, int]:
    return dict(case_mesh)


def _tp_statements(rng: random.Random, spec: Spec, sp: bool, tp: int) -> tuple[list, list]:
    """Megatron-style statements on TP (each part in one of a few styles users write), and the
    activations they must split."""
    st, expect = [], []
    kinds = set(spec.blocks)
    between = "S(1)" if sp else "R"
    if "attn" in kinds:
        attn = _blocks_of(spec, "attn")
        style = rng.choice(["heads", "heads", "plain", "none"])
        if style == "heads" and spec.fused == "none":
            st += [("shard", rf"{attn}\.body\.(q|k|v)\.weight", _col(spec), "TP", None)]
            if spec.bias:
                st += [("shard", rf"{attn}\.body\.(q|k|v)\.bias", "S(0)", "TP", None)]
        elif style == "heads":  # the fused q|k|v split by heads, section by section
            st += [("shard", rf"{attn}\.body\.qkv\.weight", _interleaved(spec, 3), "TP", None)]
            if spec.bias:
                st += [("shard", rf"{attn}\.body\.qkv\.bias", "IS(0,3)", "TP", None)]
        elif style == "plain" and spec.fused != "none":  # plain shards of the fused weight: attention gathers
            st += [("shard", rf"{attn}\.body\.qkv\.weight", _col(spec), "TP", None)]
            if spec.bias:
                st += [("shard", rf"{attn}\.body\.qkv\.bias", "S(0)", "TP", None)]
        if style != "none":
            st += [("shard", rf"{attn}\.body\.o\.weight", _row(spec), "TP", None)]
            if style == "heads" and spec.heads % tp == 0:
                expect += [(f"blocks.{i}.body.core", 0, 1, "TP") for i, k in enumerate(spec.blocks) if k == "attn"]
    if "mlp" in kinds and rng.random() < 0.8:
        mlp = _blocks_of(spec, "mlp")
        if spec.gated and spec.fused != "none":
            st += [("shard", rf"{mlp}\.body\.gate_up\.weight", _interleaved(spec, 2), "TP", None)]
            if spec.bias:
                st += [("shard", rf"{mlp}\.body\.gate_up\.bias", "IS(0,2)", "TP", None)]
        else:
            st += [("shard", rf"{mlp}\.body\.(gate|up)\.weight", _col(spec), "TP", None)]
            if spec.bias:
                st += [("shard", rf"{mlp}\.body\.(gate|up)\.bias", "S(0)", "TP", None)]
        st += [("shard", rf"{mlp}\.body\.down\.weight", _row(spec), "TP", None)]
    if "moe" in kinds and rng.random() < 0.8:
        moe = _blocks_of(spec, "moe")
        st += [("shard", rf"{moe}\.body\.experts\.gate_up_proj", "IS(1,2)", "TP", None),
               ("shard", rf"{moe}\.body\.experts\.down_proj", "S(2)", "TP", None)]
    if "conv" in kinds and rng.random() < 0.2:  # a sharded conv weight: refused with the fix
        st += [("shard", rf"{_blocks_of(spec, 'conv')}\.body\.conv\.weight", "S(0)", "TP", None)]
    # The residual stream between the blocks: sequence-sharded (SP) or replicated.
    if sp or rng.random() < 0.7:
        st += [("shard", rf"{_B}\.body\.<in>", "R", "TP", None), ("shard", rf"{_B}\.body\.<out>", between, "TP", None)]
        if sp:
            expect += [(f"blocks.{i}.norm", 0, 1, "TP") for i in range(len(spec.blocks))]
            if rng.random() < 0.5:  # the norms' gradients are partial sums over the sequence shards
                st += [("annotate", rf"{_B}\.norm\.weight\.grad", "P", "TP", None)]
    if spec.vocab:
        embed = rng.choice(["R", "S(0)", "S(1)"])  # vocabulary- or hidden-parallel
        if spec.tied:
            st += [("shard", r"(embed|head)\.weight", embed, "TP", None)]
        else:
            st += [("shard", r"embed\.weight", embed, "TP", None)]
            head = rng.choice(["R", "S(0)", "S(1)"])
            st += [("shard", r"head\.weight", head, "TP", None)]
            if head == "S(0)" and rng.random() < 0.5:
                st += [("shard", r"head\.<in>", "R", "TP", None), ("shard", r"head\.<out>", "S(-1)", "TP", None)]
                expect += [("head", "out", -1, "TP")]
        if sp or embed != "R":
            st += [("shard", r"embed\.<out>", between, "TP", None)]
    elif sp:
        st += [("shard", r"patch\.<out>", "S(3)", "TP", None)]  # (batch, dim, 1, seq): the sequence
    if spec.positions and rng.random() < 0.5:
        st += [("factory", r"pos", "S(0)", "TP", None)]
    return st, expect


def _zero3_statements(rng: random.Random, spec: Spec) -> list:
    target = rng.choice([r".*weight", r".*", rf"{_B}\..*", r".*\.(weight|bias)", r"(embed|head)\.weight"
                         if spec.tied else r".*norm\.weight"])
    dim = rng.choice(["S(0)", "S(0)", "S(1)"]) if target == rf"{_B}\..*" else "S(0)"
    if dim == "S(1)":
        target = rf"{_B}\.body\.\w+\.weight"  # 2-D tensors only
    return [("shard", target, dim, "DP", "INIT"), ("shard", target, "R", "DP", "RUN")]


def _stray_statements(rng: random.Random, spec: Spec, sizes: dict, plan: list) -> list:
    """One or two statements a user might add: a random placement for a parameter no statement
    names on that mesh dim yet, or for a block's output."""
    names = [n for n, _ in build_model(spec, 0).named_parameters()]
    out = []
    for _ in range(rng.choice([1, 2])):
        mesh = rng.choice(sorted(sizes))
        if rng.random() < 0.7:
            free = [n for n in names if not any(s[0] == "shard" and s[3] == mesh and re.fullmatch(s[1], n) for s in plan + out)]
            if not free:
                continue
            name = rng.choice(free)
            place = rng.choice(["R", "S(0)", "S(-1)", "IS(0,2)"])
            out.append(("shard", re.escape(name), place, mesh, None))
        else:
            i = rng.randrange(len(spec.blocks))
            if any(s[1].endswith("<out>") and s[3] == mesh for s in plan + out):
                continue
            out.append(("shard", rf"blocks\.{i}\.<out>", rng.choice(["R", "S(0)", "S(1)", "S(2)"]), mesh, None))
    return out


def draw_case(seed: int, world: int | None = None) -> Case:
    """One example from ``seed`` (``world``: only meshes of this many ranks)."""
    rng = random.Random(seed)
    spec = draw_spec(rng)
    mesh = rng.choice(MESHES[world] if world else [m for w in (2, 4) for m in MESHES[w]])
    sizes = _dim_sizes(mesh)
    plan, expect = [], []
    tp = sizes.get("TP", 0)
    if tp:
        sp = rng.random() < 0.5
        st, ex = _tp_statements(rng, spec, sp, tp)
        plan += st
        expect += ex
    data_dims = [d for d in ("DP", "EP") if d in sizes and not (d == "EP" and "moe" in spec.blocks)]
    if "EP" in sizes and "moe" in spec.blocks:
        moe = _blocks_of(spec, "moe")
        plan += [("experts", rf"{moe}\.body\.experts", None, "EP", None)]
        data_dims.append("EP")
    for d in data_dims:
        if rng.random() < 0.9:
            plan += [("shard", r"<in>[(x|labels)]", "S(0)", d, None)]
            expect += [("", 0, 0, d)]
    if "DP" in sizes:
        if rng.random() < 0.5:
            plan += _zero3_statements(rng, spec)
        if "moe" in spec.blocks and "EP" not in sizes and rng.random() < 0.7:
            plan += [("batch_local", rf"{_blocks_of(spec, 'moe')}\.body", None, "DP", None)]
    if rng.random() < 0.3:
        plan += _stray_statements(rng, spec, sizes, plan)
    per_rank = rng.choice([1, 1, 2])
    even = per_rank * math.prod(sizes.get(d, 1) for d in data_dims)
    batch = even if rng.random() < 0.7 else rng.choice([1, 2, 3, 4])  # 1: fewer than the ranks; 3: uneven
    case = Case(
        model=spec, mesh=mesh, plan=tuple(plan), batch=batch, seq=rng.choice([1, 3, 4, 4, 5, 8]),
        mode=rng.choice(["eager", "static"]), bucket_mb=rng.choice([25, None, 1e-4]), accum=rng.choice([1, 1, 2]),
        steps=rng.choice([2, 3]), optim=rng.choice(["sgd", "adamw"]), expect=tuple(expect), seed=seed,
    )
    return case
