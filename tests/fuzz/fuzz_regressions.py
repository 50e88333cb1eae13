"""Every failure the differential fuzzer found, kept as a case that runs every time.

``REGRESSIONS``: name -> ``Regression(case, defect)``. ``defect`` names an open defect (the case is
then a strict xfail: when the fix lands the test passes unexpectedly, and the mark must go); ``None``
for fixed ones. ``KNOWN``: the open defects and how to recognise each in a random example's verdict,
so that the random examples fail only on defects nobody has named yet.

To add a case: run ``.venv/bin/python tests/fuzz/fuzz_run.py --seed N --world W --shrink``, paste the
smallest case it prints below under a name, and say which defect it is (see docs/testing.md).
"""

from __future__ import annotations

import dataclasses
import re

from fuzz_cases import Case, Spec

__all__ = ["Regression", "REGRESSIONS", "KNOWN", "known_defect"]


@dataclasses.dataclass(frozen=True)
class Regression:
    case: Case
    defect: str | None = None  # an open defect: "issue 27 defect N: ..." (strict xfail until fixed)


def _tp_sp(col: str = "S(1)", row: str = "S(0)") -> tuple:
    """Megatron TP + SP statements for ``Spec(blocks=("attn", "mlp"), fused="split")`` (HF Conv1D sizes by default)."""
    return (
        ("shard", r"blocks\.0\.body\.qkv\.weight", col, "TP", None),
        ("shard", r"blocks\.0\.body\.qkv\.bias", "S(0)", "TP", None),
        ("shard", r"blocks\.0\.body\.o\.weight", row, "TP", None),
        ("shard", r"blocks\.1\.body\.up\.weight", col, "TP", None),
        ("shard", r"blocks\.1\.body\.up\.bias", "S(0)", "TP", None),
        ("shard", r"blocks\.1\.body\.down\.weight", row, "TP", None),
        ("shard", r"blocks\.\d+\.body\.<in>", "R", "TP", None),
        ("shard", r"blocks\.\d+\.body\.<out>", "S(1)", "TP", None),
        ("shard", r"embed\.<out>", "S(1)", "TP", None),
    )


_DP = (("shard", r"<in>[(x|labels)]", "S(0)", "DP", None),)
_ZERO3_BLOCKS = (("shard", r"blocks\.\d+\..*", "S(0)", "DP", "INIT"), ("shard", r"blocks\.\d+\..*", "R", "DP", "RUN"))
_DPxTP = (("DP", 2), ("TP", 2))

REGRESSIONS: dict[str, Regression] = {
    # Issue 27 defect 1: GPT-2's layout (HF Conv1D, a fused c_attn cut with split, biases, tied
    # embedding and head, dropout) with plain Shard(1)/Shard(0) shards of c_attn, DP x TP + SP and
    # every block parameter ZeRO-3'd: losses drift from step 1 on.
    "gpt2_conv1d_bias_zero3": Regression(
        Case(model=Spec(blocks=("attn", "mlp"), dim=16, heads=4, proj="conv1d", fused="split", tied=True, dropout=0.1),
             mesh=_DPxTP, plan=_tp_sp() + _DP + _ZERO3_BLOCKS, batch=4, seq=8, steps=3, optim="adamw",
             expect=(("", 0, 0, "DP"), ("blocks.0.norm", 0, 1, "TP")), must_run=True),
        # fixed: vescale.comm.moves.split_steps (one split at a time)
    ),
    # Issue 27 defect 4: a fused q|k|v InterleavedShard(0, 3) cut with x[..., a:b] (Phi-3) or narrow
    # gathers the heads: attention runs replicated on every TP rank (losses still match).
    "interleaved_qkv_index": Regression(
        Case(model=Spec(blocks=("attn",), fused="index"), mesh=(("TP", 2),),
             plan=(("shard", r"blocks\.0\.body\.qkv\.(weight|bias)", "IS(0,3)", "TP", None),
                   ("shard", r"blocks\.0\.body\.o\.weight", "S(1)", "TP", None)),
             expect=(("blocks.0.body.core", 0, 1, "TP"),), must_run=True),
        # fixed: vescale.dispatch.fast.interleaved (section-aligned slices stay local)
    ),
    "interleaved_qkv_narrow": Regression(
        Case(model=Spec(blocks=("attn",), fused="narrow"), mesh=(("TP", 2),),
             plan=(("shard", r"blocks\.0\.body\.qkv\.(weight|bias)", "IS(0,3)", "TP", None),
                   ("shard", r"blocks\.0\.body\.o\.weight", "S(1)", "TP", None)),
             expect=(("blocks.0.body.core", 0, 1, "TP"),), must_run=True),
        # fixed: vescale.dispatch.fast.interleaved
    ),
    # The split and chunk of the same layout stay local: the check above is not vacuous.
    "interleaved_qkv_split": Regression(
        Case(model=Spec(blocks=("attn",), fused="split"), mesh=(("TP", 2),),
             plan=(("shard", r"blocks\.0\.body\.qkv\.(weight|bias)", "IS(0,3)", "TP", None),
                   ("shard", r"blocks\.0\.body\.o\.weight", "S(1)", "TP", None)),
             expect=(("blocks.0.body.core", 0, 1, "TP"),), must_run=True),
    ),
    # Issue 27 defect 5: the tied embedding / head cannot be ZeRO-3'd (a PlanError today); it must
    # train and be stored 1/DP per rank.
    "tied_embedding_zero3": Regression(
        Case(model=Spec(blocks=("attn",), tied=True), mesh=(("DP", 2),),
             plan=_DP + (("shard", r"(embed|head)\.weight", "S(0)", "DP", "INIT"),
                         ("shard", r"(embed|head)\.weight", "R", "DP", "RUN")),
             expect=(("", 0, 0, "DP"),), must_run=True),
        # fixed: vescale.parallel.zero (tied parameters gathered before each holder)
    ),
    # Issue 27 defect 3: a vocabulary-parallel embedding without SP in front of an MoE block fails in
    # the first backward with DTensor's raw "P(sum) to MaskP" assertion; it must run, or be a PlanError.
    "vocab_parallel_embedding_moe_no_sp": Regression(
        Case(model=Spec(blocks=("attn", "moe")), mesh=(("TP", 2),),
             plan=(("shard", r"embed\.weight", "S(0)", "TP", None), ("shard", r"embed\.<out>", "R", "TP", None),
                   ("shard", r"blocks\.0\.body\.(q|k|v)\.(weight|bias)", "S(0)", "TP", None),
                   ("shard", r"blocks\.0\.body\.o\.weight", "S(1)", "TP", None),
                   ("shard", r"blocks\.1\.body\.experts\.gate_up_proj", "IS(1,2)", "TP", None),
                   ("shard", r"blocks\.1\.body\.experts\.down_proj", "S(2)", "TP", None),
                   ("shard", r"blocks\.\d+\.body\.<in>", "R", "TP", None),
                   ("shard", r"blocks\.\d+\.body\.<out>", "R", "TP", None)),
             expect=(("blocks.0.body.core", 0, 1, "TP"),)),
        # fixed: vescale.comm.moves (a Partial gradient of another kind handed back as it arrives)
    ),
}


# Found by the fuzzer, fixed (vescale/dispatch/coverage/conv.py): PyTorch's convolution handlers gave a wrong
# output for a Conv1d on a sequence-split input (their halo exchange is 4-D and uses global ranks),
# labelled the weight's gradient Partial on mesh dim 0 whatever split the batch, and refused a batch
# split on two mesh dims with a raw "hybrid sharding" ValueError.
REGRESSIONS["conv1d_sequence_parallel"] = Regression(Case(
    model=Spec(blocks=("conv",)), mesh=(("TP", 2),), batch=2, seq=4,
    plan=(("shard", r"blocks\.\d+\.body\.<in>", "S(1)", "TP", None), ("shard", r"blocks\.\d+\.body\.<out>", "S(1)", "TP", None),
          ("shard", r"embed\.<out>", "S(1)", "TP", None)),
    expect=(("blocks.0.norm", 0, 1, "TP"),), must_run=True))
REGRESSIONS["conv2d_batch_on_two_mesh_dims"] = Regression(Case(
    model=Spec(blocks=("mlp",), vocab=0), mesh=(("DP", 2), ("EP", 2)), batch=4, seq=4, mode="static",
    plan=(("shard", r"<in>[(x|labels)]", "S(0)", "DP", None), ("shard", r"<in>[(x|labels)]", "S(0)", "EP", None)),
    expect=(("", 0, 0, "DP"), ("", 0, 0, "EP")), must_run=True))
REGRESSIONS["conv2d_batch_on_dp_with_a_unit_dim"] = Regression(Case(
    model=Spec(blocks=("mlp",), vocab=0), mesh=(("DP", 2), ("EP", 1)), batch=2, seq=4,
    plan=(("shard", r"<in>[(x|labels)]", "S(0)", "DP", None), ("shard", r"<in>[(x|labels)]", "S(0)", "EP", None)),
    expect=(("", 0, 0, "DP"),), must_run=True))
# Found by the fuzzer, fixed (vescale/static/local_sizes.py): HF Conv1D's view(*x.size()[:-1], nf)
# under DP x TP passes the batch read from the local tensor beside the global width nf; static steps
# refused it ("the module must reshape the same way every step").
REGRESSIONS["static_conv1d_view_local_batch_global_width"] = Regression(Case(
    model=Spec(blocks=("mlp",), proj="conv1d"), mesh=(("DP", 2), ("TP", 2)), batch=4, seq=5, mode="static", steps=3,
    plan=(("shard", r"blocks\.0\.body\.up\.weight", "S(1)", "TP", None), ("shard", r"blocks\.0\.body\.up\.bias", "S(0)", "TP", None),
          ("shard", r"blocks\.0\.body\.down\.weight", "S(0)", "TP", None)) + _DP,
    expect=(("", 0, 0, "DP"),), must_run=True))
# Found by the fuzzer, fixed (slice_backward keyed by what the rules read, vescale/dispatch/fast/cache.py): the backward of
# ``narrow(-1, ...)`` of a replicated fused gate|up output feeding a row-parallel matmul fails with
# "The size of tensor a (0) must match the size of tensor b (8)"; the same slice written x[..., a:b] works.
REGRESSIONS["narrow_backward_into_row_parallel"] = Regression(Case(
    model=Spec(blocks=("mlp",), fused="narrow", gated=True, bias=False), mesh=(("TP", 2),), batch=2, seq=3, steps=1,
    plan=(("shard", r"blocks\.0\.body\.down\.weight", "S(1)", "TP", None),)))


def _global_batch_below_tp() -> Case:
    """Issue 27 defect 2: one sequence per DP rank, a global batch below the TP size (LLaMA-like: TP +
    SP + ZeRO-3 on DP=2 x TP=4): the first forward fails in ``_unsafe_view``. 8 ranks."""
    plan = (
        ("shard", r"blocks\.0\.body\.(q|k|v)\.weight", "S(0)", "TP", None),
        ("shard", r"blocks\.0\.body\.o\.weight", "S(1)", "TP", None),
        ("shard", r"blocks\.1\.body\.(gate|up)\.weight", "S(0)", "TP", None),
        ("shard", r"blocks\.1\.body\.down\.weight", "S(1)", "TP", None),
        ("shard", r"blocks\.\d+\.body\.<in>", "R", "TP", None),
        ("shard", r"blocks\.\d+\.body\.<out>", "S(1)", "TP", None),
        ("shard", r"embed\.weight", "S(0)", "TP", None),
        ("shard", r"embed\.<out>", "S(1)", "TP", None),
    ) + _DP + (("shard", r".*weight", "S(0)", "DP", "INIT"), ("shard", r".*weight", "R", "DP", "RUN"))
    spec = Spec(blocks=("attn", "mlp"), dim=16, heads=4, bias=False, gated=True, norm="rms")
    return Case(model=spec, mesh=(("DP", 2), ("TP", 4)), plan=plan, batch=2, seq=8,
                expect=(("", 0, 0, "DP"), ("blocks.0.body.core", 0, 1, "TP")), must_run=True)


REGRESSIONS["global_batch_below_tp"] = Regression(_global_batch_below_tp())  # fixed: vescale.dispatch.fast.viewrule


# Found by the fuzzer after the static33 / dispfix merge (seed 100010, pasted as drawn): HF Mixtral's MoE block
# reshapes its DP x EP split output by the batch of its DP-split input; a static step refused reshape(2, 4, 16)
# where the recording saw reshape(4, *, *) (local (1, 4, 16)).
REGRESSIONS["static_ep_moe_reshape_by_input_batch"] = Regression(Case(
    model=Spec(blocks=("mlp", "moe", "attn"), dim=16, heads=4, vocab=16, proj="linear", bias=True, fused="chunk", attn="eager",
               norm="layer", gated=False, dropout=0.1, tied=True, positions=True, experts="grouped_mm"),
    mesh=(("DP", 2), ("EP", 2)),
    plan=(("experts", r"blocks\.(1)\.body\.experts", None, "EP", None), ("shard", r"<in>[(x|labels)]", "S(0)", "DP", None),
          ("shard", r".*", "S(0)", "DP", "INIT"), ("shard", r".*", "R", "DP", "RUN")),
    batch=4, seq=4, mode="static", bucket_mb=25, accum=1, steps=3, optim="adamw", expect=(("", 0, 0, "DP"),), seed=100010),
    defect=None)  # fixed: a whole share of a global size gets the local size (static/local_sizes.py _whole_share)
REGRESSIONS["view_of_a_dim_split_on_a_unit_mesh_dim"] = Regression(Case(
    model=Spec(blocks=("attn", "conv"), dim=8, heads=1, vocab=0, proj="conv1d", bias=True, fused="narrow", attn="sdpa", norm="layer",
               gated=True, dropout=0.0, tied=False, positions=True, experts="grouped_mm"),
    mesh=(("DP", 4), ("TP", 1)),
    plan=(("shard", r"blocks\.(1)\.body\.conv\.weight", "S(0)", "TP", None), ("shard", r"blocks\.\d+\.body\.<in>", "R", "TP", None),
          ("shard", r"blocks\.\d+\.body\.<out>", "S(1)", "TP", None), ("shard", r"patch\.<out>", "S(3)", "TP", None),
          ("factory", "pos", "S(0)", "TP", None), ("shard", r"<in>[(x|labels)]", "S(0)", "DP", None),
          ("shard", r"blocks\.\d+\..*", "S(0)", "DP", "INIT"), ("shard", r"blocks\.\d+\..*", "R", "DP", "RUN")),
    batch=4, seq=1, mode="static", bucket_mb=0.0001, accum=1, steps=3, optim="adamw",
    expect=(("blocks.0.norm", 0, 1, "TP"), ("blocks.1.norm", 0, 1, "TP"), ("", 0, 0, "DP")), seed=100002),
    defect=None)  # fixed: a shard on a mesh dim of one rank is decided as Replicate (dispatch/fast/viewrule.py, dispatch/coverage/conv.py)
REGRESSIONS["seed9_static_dp_ep1_tp1_hang"] = Regression(Case(
    model=Spec(blocks=("mlp", "attn"), dim=8, heads=1, vocab=15, proj="linear", bias=True, fused="index", attn="sdpa", norm="rms",
               gated=False, dropout=0.0, tied=False, positions=True, experts="batched_mm"),
    mesh=(("DP", 2), ("EP", 1), ("TP", 1)),
    plan=(("shard", r"blocks\.(1)\.body\.qkv\.weight", "IS(0,3)", "TP", None), ("shard", r"blocks\.(1)\.body\.qkv\.bias", "IS(0,3)", "TP", None),
          ("shard", r"blocks\.(1)\.body\.o\.weight", "S(1)", "TP", None), ("shard", r"blocks\.(0)\.body\.(gate|up)\.weight", "S(0)", "TP", None),
          ("shard", r"blocks\.(0)\.body\.(gate|up)\.bias", "S(0)", "TP", None), ("shard", r"blocks\.(0)\.body\.down\.weight", "S(1)", "TP", None),
          ("shard", r"blocks\.\d+\.body\.<in>", "R", "TP", None), ("shard", r"blocks\.\d+\.body\.<out>", "S(1)", "TP", None),
          ("annotate", r"blocks\.\d+\.norm\.weight\.grad", "P", "TP", None), ("shard", r"embed\.weight", "S(1)", "TP", None),
          ("shard", r"head\.weight", "S(1)", "TP", None), ("shard", r"embed\.<out>", "S(1)", "TP", None), ("factory", "pos", "S(0)", "TP", None),
          ("shard", r"<in>[(x|labels)]", "S(0)", "DP", None), ("shard", r"<in>[(x|labels)]", "S(0)", "EP", None)),
    batch=2, seq=8, mode="static", bucket_mb=25, accum=1, steps=2, optim="adamw",
    expect=(("blocks.1.body.core", 0, 1, "TP"), ("blocks.0.norm", 0, 1, "TP"), ("blocks.1.norm", 0, 1, "TP"), ("", 0, 0, "DP"), ("", 0, 0, "EP")),
    seed=9),
    defect=None)  # fixed with the unit-mesh-dim view decision (dispatch/fast/viewrule.py): 118 s to the watchdog before, 19 s now


# The open defects, and how a random example's verdict shows each: (defect, case predicate, detail regex).
KNOWN: list = []


def known_defect(case: Case, detail: str) -> str | None:
    """The open defect a failing example's verdict shows, or None for a new one."""
    for defect, applies, pattern in KNOWN:
        if applies(case) and re.search(pattern, detail):
            return defect
    return None
