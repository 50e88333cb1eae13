"""Lowering a VescalePlan against a model and a (fake, single-process) (2, 2) mesh into Plan IR.

Covers regex resolution over tensor paths, the ``<in>`` / ``<out>`` key normalisation, the printed IR,
fusion, de-duplication, conflicts, INIT/RUN phases (ZeRO-3 gathers), every lowering error, explain(),
and the zoo's LLaMA plan on our model and on HuggingFace's.
"""

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import vescale
from vescale import INIT, RUN, InterleavedShard, PlanError, VescalePlan
from vescale.plan import Phase, lower
from vescale.model_state import state_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x, scale=1.0):
        return self.fc2(self.fc1(x)) * scale


class Pair(nn.Module):
    """Returns a tuple."""

    def forward(self, a, b):
        return a + b, a - b


class VarArgs(nn.Module):
    def forward(self, *xs):
        return sum(xs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.pair = Pair()
        self.many = VarArgs()
        self.head = nn.Linear(4, 2)
        self.register_buffer("table", torch.zeros(6, 4))

    def forward(self, x):
        a, b = self.pair(self.mlp(x), x)
        return self.head(self.many(a, b)) + self.table.sum()


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.embed(ids))


WEIGHTS = ["mlp.fc1.weight", "mlp.fc2.weight", "head.weight"]


@pytest.fixture
def net():
    return Net()


def lines(plan, model, mesh) -> list[str]:
    """The printed IR's entries (without its header line and its coverage report)."""
    return [t for t in str(lower(plan, model, mesh)).splitlines()[1:] if not t.startswith("# ")]


def entry(ir, text: str):
    (found,) = [e for e in ir.entries if str(e) == text]
    return found


def plan_of(*statements) -> VescalePlan:
    plan = VescalePlan()
    for path, placement, kwargs in statements:
        plan.shard(path, placement, **kwargs)
    return plan


TP, DP = {"mesh": "TP"}, {"mesh": "DP"}


# ---------------------------------------------------------------------------------------------
# Resolution: regexes over parameter names and module paths
# ---------------------------------------------------------------------------------------------


def test_regex_full_matches_parameter_names(net, mesh):
    ir = lower(plan_of((r".*weight", Shard(0), TP)), net, mesh)
    planned = {e.name for e in ir.raw}
    assert planned == set(WEIGHTS)  # not the biases, not the buffer "table"
    # A prefix is not a match: "mlp\.fc1" names a module, not a tensor.
    with pytest.raises(PlanError, match="path matches no parameter or buffer"):
        lower(plan_of((r"mlp\.fc1", Shard(0), TP)), net, mesh)
    # Nor is a substring: "fc1\.weight" does not match "mlp.fc1.weight".
    with pytest.raises(PlanError, match="path matches no parameter or buffer"):
        lower(plan_of((r"fc1\.weight", Shard(0), TP)), net, mesh)


def test_every_parameter_gets_an_entry_and_unplanned_ones_are_replicated(net, mesh):
    ir = lower(plan_of((r"mlp\.fc1\.weight", Shard(0), TP)), net, mesh)
    params = {f"{e.module}.{e.tensor}": e.targets for e in ir.entries if e.hook == "param"}
    assert set(params) == {n for n, _ in net.named_parameters()}  # unplanned buffers stay plain
    assert params["mlp.fc1.weight"] == (Replicate(), Shard(0))
    assert all(t == (Replicate(), Replicate()) for n, t in params.items() if n != "mlp.fc1.weight")


def test_planned_buffer_gets_an_entry(net, mesh):
    assert "param:table::distribute(R,DP; S(0),TP)" in lines(plan_of(("table", Shard(0), TP)), net, mesh)


def test_activation_statements_resolve_to_module_paths(net, mesh):
    ir = lower(plan_of((r"mlp\.fc\d\.<in>", Replicate(), TP), (r"mlp\.<out>", Shard(0), DP)), net, mesh)
    acts = [(e.module, e.hook, e.tensor, e.key) for e in ir.entries if e.hook != "param"]
    assert acts == [
        ("mlp", "forward", "<out>", 0),
        ("mlp.fc1", "forward_pre", "<in>", "input"),  # nn.Linear.forward(self, input)
        ("mlp.fc2", "forward_pre", "<in>", "input"),
    ]


def test_root_module_is_the_empty_path(net, mesh):
    assert lines(plan_of(("<in>", Shard(0), DP)), net, mesh)[0] == "forward_pre:<in>:x:redist(->S(0),DP)"


@pytest.mark.parametrize(
    "path", [r"mlp\.<in>", r"mlp\.<in>[0]", r"mlp\.<in>\[0\]", r"mlp\.<in>[x]", r"mlp\.<in>\[x\]"]
)
def test_input_forms_name_the_same_tensor(path, net, mesh):
    ir = lower(plan_of((path, Replicate(), TP)), net, mesh)
    assert [str(e) for e in ir.entries if e.tensor == "<in>"] == ["mlp.forward_pre:<in>:x:redist(->R,TP)"]


def test_positional_and_keyword_input_normalise_to_one_key(net, mesh):
    # <in>[1] and <in>[scale] are one tensor, whether the caller passes scale positionally or not:
    # the two statements fuse into one entry instead of two.
    ir = lower(plan_of((r"mlp\.<in>[1]", Replicate(), TP), (r"mlp\.<in>[scale]", Shard(0), DP)), net, mesh)
    assert [str(e) for e in ir.entries if e.tensor == "<in>"] == ["mlp.forward_pre:<in>:scale:redist(->S(0),DP; R,TP)"]


def test_varargs_inputs_keep_their_position(net, mesh):
    ir = lower(plan_of((r"many\.<in>[1]", Replicate(), TP)), net, mesh)
    assert entry(ir, "many.forward_pre:<in>:1:redist(->R,TP)").key == 1


def test_output_keys(net, mesh):
    plan = plan_of(
        (r"pair\.<out>[1]", Replicate(), TP), (r"pair\.<out>[diff]", Replicate(), DP), (r"head\.<out>", Shard(0), DP)
    )
    outs = [str(e) for e in lower(plan, net, mesh).entries if e.tensor == "<out>"]
    assert outs == [
        "pair.forward:<out>:1:redist(->R,TP)",  # an int key: element 1 of the tuple
        "pair.forward:<out>:diff:redist(->R,DP)",  # a name: a field, if the output is dict-like (checked at run time)
        "head.forward:<out>:0:redist(->S(0),DP)",
    ]
    assert {type(e.key) for e in lower(plan, net, mesh).entries if e.tensor == "<out>" and e.key is not None} == {int, str}


# ---------------------------------------------------------------------------------------------
# The IR: text, fusion, duplicates, conflicts, phases, order
# ---------------------------------------------------------------------------------------------


def test_ir_text_format(net, mesh):
    plan = plan_of(
        (r"mlp\.<in>", Replicate(), TP),
        (r"mlp\.fc1\.weight", [Shard(1), Shard(0)], {}),
        (r"mlp\.<out>", Shard(1), TP),
    )
    ir = lower(plan, net, mesh)
    text = str(ir).splitlines()
    counts = f"{len(ir.raw)} raw entries -> {len(ir.entries)} entries in {len(ir.hooks())} hooks"
    assert text[0] == f"# Plan IR: {counts}; mesh dims ('DP', 'TP')"
    # Then the coverage report, one line per mesh dim (see test_coverage.py).
    assert len(text) == 1 + len(ir.entries) + 2 and all(t.startswith("# ") for t in text[-2:])
    for line in [
        "mlp.forward_pre:<in>:x:redist(->R,TP)",
        "mlp.forward:<out>:0:redist(->S(1),TP)",
        "mlp.fc1.param:bias::distribute(R,DP; R,TP)",
        "mlp.fc1.param:weight::distribute(S(1),DP; S(0),TP)",
    ]:
        assert line in text
    assert repr(ir) == str(ir)


def test_statements_on_different_mesh_dims_fuse_into_one_entry(net, mesh):
    ir = lower(plan_of((r"mlp\.fc1\.weight", Shard(0), TP), (r"mlp\.fc1\.weight", Shard(1), DP)), net, mesh)
    fused = entry(ir, "mlp.fc1.param:weight::distribute(S(1),DP; S(0),TP)")
    assert fused.statements == (0, 1) and fused.targets == (Shard(1), Shard(0))
    ir = lower(plan_of((r"mlp\.<in>", Replicate(), TP), (r"mlp\.<in>[x]", Shard(0), DP)), net, mesh)
    assert entry(ir, "mlp.forward_pre:<in>:x:redist(->S(0),DP; R,TP)").statements == (0, 1)


def test_activation_dims_left_unplanned_are_left_alone(net, mesh):
    e = entry(lower(plan_of((r"mlp\.<in>", Replicate(), TP)), net, mesh), "mlp.forward_pre:<in>:x:redist(->R,TP)")
    assert e.targets == (None, Replicate())  # None: the DP placement the input arrives with is kept


def test_duplicate_statements_are_dropped(net, mesh):
    once = lower(plan_of((r".*weight", Shard(0), TP), (r"mlp\.<in>", Replicate(), TP)), net, mesh)
    twice = lower(
        plan_of(
            (r".*weight", Shard(0), TP),
            (r"mlp\.fc1\.weight", Shard(0), TP),  # also matched by .*weight
            (r"mlp\.<in>", Replicate(), TP),
            (r"mlp\.<in>[x]", Replicate(), TP),  # the same tensor
        ),
        net,
        mesh,
    )
    assert len(twice.raw) > len(once.raw)
    assert [str(e) for e in twice.entries] == [str(e) for e in once.entries]


def test_conflict_quotes_both_statements(net, mesh):
    plan = plan_of((r"mlp\.fc1\.weight", Shard(0), TP), (r"mlp\..*\.weight", Shard(1), TP))
    with pytest.raises(PlanError) as err:
        lower(plan, net, mesh)
    message = str(err.value)
    assert "conflicting placements for parameter 'mlp.fc1.weight'" in message
    assert f"{plan.statements[0]} asks for S(0) but {plan.statements[1]} asks for S(1)" in message

    plan = plan_of((r"mlp\.<in>", Replicate(), TP), (r"mlp\.<in>[x]", Shard(0), TP))
    with pytest.raises(PlanError) as err:
        lower(plan, net, mesh)
    assert "conflicting placements for <in>[x] of module 'mlp'" in str(err.value)
    assert f"{plan.statements[0]} asks for R but {plan.statements[1]} asks for S(0)" in str(err.value)


def test_init_and_run_phases_give_distribute_and_gather(net, mesh):
    plan = plan_of(
        (r".*weight", Shard(0), {**DP, "phase": INIT}),
        (r".*weight", Replicate(), {**DP, "phase": RUN}),
        (r"mlp\.fc1\.weight", Shard(0), TP),  # no phase: both
    )
    ir = lower(plan, net, mesh)
    text = [str(e) for e in ir.entries if e.module == "mlp.fc1"]
    # Different INIT and RUN placements of one tensor and mesh dim are two phases, not a conflict.
    # The ZeRO shard (DP) of a weight TP shards on the same dim is laid out inside the TP shard
    # (InterleavedShard(0, TP) on DP, vescale.placement.nested), so its gather is over DP alone.
    assert sorted(text) == [
        "mlp.fc1.forward_pre:weight::gather(IS(0,2),DP; S(0),TP->R,DP; S(0),TP)",
        "mlp.fc1.param:bias::distribute(R,DP; R,TP)",
        "mlp.fc1.param:weight::distribute(IS(0,2),DP; S(0),TP)",
    ]
    assert text[-1].startswith("mlp.fc1.forward_pre:weight::gather")  # after the module's param entries
    gather = entry(ir, text[-1])
    assert gather.action == "gather" and gather.sources == (InterleavedShard(0, 2), Shard(0)) and gather.targets == (Replicate(), Shard(0))
    # Every weight (and no bias) is gathered, by its own module, before that module runs.
    assert sorted(f"{e.module}.{e.tensor}" for e in ir.entries if e.action == "gather") == sorted(WEIGHTS)


def test_phase_less_statement_applies_to_both_phases(net, mesh):
    ir = lower(plan_of((r"mlp\.fc1\.weight", Shard(0), TP)), net, mesh)
    assert sorted(e.phase.value for e in ir.raw) == ["INIT", "RUN"]
    assert not [e for e in ir.entries if e.action == "gather"]  # same placement in both: nothing to gather
    # One phase alone also holds in the other: a RUN-only placement is stored that way too.
    ir = lower(plan_of((r"mlp\.fc1\.weight", Shard(0), {**DP, "phase": RUN})), net, mesh)
    assert "mlp.fc1.param:weight::distribute(S(0),DP; R,TP)" in [str(e) for e in ir.entries]
    assert not [e for e in ir.entries if e.action == "gather"]
    assert {e.phase for e in ir.raw} == {Phase.RUN}


def test_entries_follow_module_order_then_hook_order(net, mesh):
    plan = plan_of((r"head\.<in>", Replicate(), TP), (r"mlp\.<out>", Shard(0), DP), (r"mlp\.<in>", Replicate(), TP))
    plan.factory("mlp", Replicate(), mesh="TP")
    mlp_lines = [line for line in lines(plan, net, mesh) if line.startswith("mlp.") and not line.startswith("mlp.fc")]
    assert mlp_lines == [
        "mlp.factory:<factory>::factory(->R,TP)",
        "mlp.forward_pre:<in>:x:redist(->R,TP)",
        "mlp.forward:<out>:0:redist(->S(0),DP)",
    ]
    modules = [e.module for e in lower(plan, net, mesh).entries]
    order = [name for name, _ in net.named_modules()]
    assert modules == sorted(modules, key=order.index)


def test_hooks_group_entries_by_module_and_hook(net, mesh):
    ir = lower(plan_of((r"mlp\.<in>", Replicate(), TP), (r"mlp\.<in>[scale]", Replicate(), TP)), net, mesh)
    assert sorted(str(e) for e in ir.hooks()[("mlp", "forward_pre")]) == [
        "mlp.forward_pre:<in>:scale:redist(->R,TP)",
        "mlp.forward_pre:<in>:x:redist(->R,TP)",
    ]
    # Every entry but the parameter placements (applied once, by parallelize) is in exactly one hook.
    assert sum(len(group) for group in ir.hooks().values()) == sum(e.hook != "param" for e in ir.entries)


def test_negative_shard_dim_is_normalised(net, mesh):
    assert "mlp.fc1.param:weight::distribute(R,DP; S(1),TP)" in lines(plan_of((r"mlp\.fc1\.weight", Shard(-1), TP)), net, mesh)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def raises(message: str):
    """pytest.raises(PlanError) whose message contains ``message`` literally."""
    return pytest.raises(PlanError, match=re.escape(message))


def test_path_matching_nothing_names_the_closest_real_paths(net, mesh):
    with pytest.raises(PlanError) as err:
        lower(plan_of((r"mlp\.fc3\.weight", Shard(0), TP)), net, mesh)
    assert str(err.value).startswith(r"#0 plan.shard('mlp\\.fc3\\.weight', S(0), mesh='TP'): path matches no parameter")
    assert "closest real paths: mlp.fc2.weight, mlp.fc1.weight" in str(err.value)

    with raises("no module path matches; closest real paths: mlp.<in>"):
        lower(plan_of((r"mlpp\.<in>", Replicate(), TP)), net, mesh)


def test_shard_dim_out_of_range_names_the_tensor_and_its_ndim(net, mesh):
    with raises("Shard(2) does not fit 'mlp.fc1.weight', which has 2 dimension(s); use a dim in [0, 2)"):
        lower(plan_of((r"mlp\.fc1\.weight", Shard(2), TP)), net, mesh)
    with raises("Shard(-2) does not fit 'head.bias', which has 1 dimension(s)"):
        lower(plan_of((r"head\.bias", Shard(-2), TP)), net, mesh)


def test_unknown_mesh_dim_lists_the_mesh_dims(net, mesh):
    with raises("mesh dimension 'tp' does not exist; this mesh has dimensions ('DP', 'TP')"):
        lower(plan_of((r"head\.weight", Shard(0), {"mesh": "tp"})), net, mesh)


@pytest.mark.parametrize("placements", [Shard(0), [Shard(0), Replicate(), Replicate()]])
def test_wrong_number_of_placements_for_the_mesh(placements, net, mesh):
    n = 1 if isinstance(placements, Shard) else len(placements)
    with raises(f"gives {n} placement(s) for a 2-D mesh ('DP', 'TP'); name the mesh dimension (mesh='TP')"):
        lower(plan_of((r"head\.weight", placements, {})), net, mesh)


def test_input_index_beyond_the_forward_arguments(net, mesh):
    with raises("module 'mlp' (MLP.forward) has only 2 input(s) ['x', 'scale']; <in>[2] does not exist"):
        lower(plan_of((r"mlp\.<in>[2]", Replicate(), TP)), net, mesh)


def test_unknown_argument_name(net, mesh):
    with raises("module 'mlp' (MLP.forward) has no argument matching 'y'; its arguments are ['x', 'scale']"):
        lower(plan_of((r"mlp\.<in>[y]", Replicate(), TP)), net, mesh)


def test_partial_parameter_is_rejected(net, mesh):
    with raises("'head.weight' is a parameter/buffer and cannot be Partial; use Shard or Replicate"):
        lower(plan_of((r"head\.weight", Partial(), TP)), net, mesh)


def test_tied_parameters_must_be_planned_alike(mesh):
    names = "parameters ['embed.weight', 'head.weight'] are one shared (tied) tensor"
    with raises(f"{names} but the plan places them differently"):
        lower(plan_of((r"embed\.weight", Shard(0), TP)), Tied(), mesh)
    # Planned alike, they are one tensor with one entry, under its first name.
    alike = plan_of((r"(embed|head)\.weight", Shard(0), TP))
    assert lines(alike, Tied(), mesh) == ["embed.param:weight::distribute(R,DP; S(0),TP)"]


def test_tied_parameter_under_zero3_is_gathered_before_each_module_that_holds_it(mesh):
    """One distribute entry (one tensor, stored once), a gather before each of its modules."""
    zero3 = plan_of((r".*weight", Shard(0), {**DP, "phase": INIT}), (r".*weight", Replicate(), {**DP, "phase": RUN}))
    assert lines(zero3, Tied(), mesh) == [
        "embed.param:weight::distribute(S(0),DP; R,TP)",
        "embed.forward_pre:weight::gather(S(0),DP; R,TP->R,DP; R,TP)",
        "head.forward_pre:weight::gather(S(0),DP; R,TP->R,DP; R,TP)",
    ]
    # Still: every name of the shared tensor gets the same statements.
    half = plan_of((r"embed\.weight", Shard(0), {**DP, "phase": INIT}), (r"embed\.weight", Replicate(), {**DP, "phase": RUN}))
    with raises("parameters ['embed.weight', 'head.weight'] are one shared (tied) tensor but the plan places them differently"):
        lower(half, Tied(), mesh)


def test_lower_checks_its_arguments(net, mesh, fake_world):
    with pytest.raises(TypeError, match="expected a vescale.VescalePlan, got list"):
        lower([], net, mesh)
    unnamed = init_device_mesh("cpu", (4,))
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh with named dimensions"):
        lower(VescalePlan(), net, unnamed)


def test_out_and_out_0_conflict_is_detected(net, mesh):
    with pytest.raises(PlanError, match="conflicting placements"):
        lower(plan_of((r"mlp\.<out>", Shard(0), TP), (r"mlp\.<out>[0]", Replicate(), TP)), net, mesh)


def test_conflict_on_an_output_names_the_module(net, mesh):
    plan = plan_of((r"mlp\.<out>", Shard(0), TP), (r"(mlp|head)\.<out>", Replicate(), TP))
    with pytest.raises(PlanError, match="'mlp'"):
        lower(plan, net, mesh)


def test_dot_in_pattern_does_not_match_the_root_input(net, mesh):
    ir = lower(plan_of((r".*\.<in>", Replicate(), TP)), net, mesh)
    assert "" not in {e.module for e in ir.entries}


def test_any_regex_ending_in_in_is_an_activation_path(net, mesh):
    ir = lower(plan_of((r".*<in>", Replicate(), TP)), net, mesh)
    assert {e.module for e in ir.entries if e.tensor == "<in>"} == {m for m, _ in net.named_modules()}


def test_factory_matching_nothing_suggests_module_paths(net, mesh):
    with pytest.raises(PlanError, match=r"closest real paths: mlp(,|$)"):
        lower(VescalePlan().factory("mlpx", Replicate(), mesh="TP"), net, mesh)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_activation_of_a_container_that_never_runs_is_refused(mesh):
    with pytest.raises(PlanError, match="ModuleList"):
        lower(plan_of((r"layers\.<in>", Shard(0), DP)), Stack(), mesh)


class KwargsOnly(nn.Module):
    def forward(self, **batch):
        return batch["x"]


def test_input_of_a_kwargs_forward(mesh):
    plan = plan_of((r"<in>[x]", Replicate(), TP))
    try:
        lines(plan, KwargsOnly(), mesh)
    except PlanError as e:
        assert "**" in str(e), str(e)


# ---------------------------------------------------------------------------------------------
# explain()
# ---------------------------------------------------------------------------------------------


def test_explain_prints_one_line_per_entry_and_changes_nothing(net, mesh, capsys):
    plan = plan_of((r".*weight", Shard(0), TP), (r"mlp\.<in>", Replicate(), TP))
    before = {n: p.clone() for n, p in net.state_dict().items()}
    ir = vescale.explain(net, plan, mesh)
    print(ir)
    printed = capsys.readouterr().out.splitlines()
    n = len(ir.entries)
    assert printed[0].startswith("# Plan IR:") and printed[1 : 1 + n] == [str(e) for e in ir.entries]
    assert printed[1 + n :] == ir.report().splitlines()
    assert all(type(p) is nn.Parameter for p in net.parameters())
    assert all(torch.equal(before[n], t) for n, t in net.state_dict().items())
    assert not (state_of(net).ir is not None)
    with pytest.raises(PlanError):  # the same errors as parallelize
        vescale.explain(net, plan_of((r"nothing", Shard(0), TP)), mesh)


# ---------------------------------------------------------------------------------------------
# The zoo's plan on both LLaMA implementations
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llamas():
    from vescale.zoo import tiny_hf_llama, tiny_llama

    return tiny_llama(), tiny_hf_llama(use_cache=False)


@pytest.mark.parametrize("zero3", [False, True])
def test_zoo_plan_ir_on_ours_and_huggingface_differs_only_at_the_embeddings(llamas, mesh, zero3):
    from vescale.zoo import llama_plan

    ours, theirs = llamas
    ir_ours = lower(llama_plan(mesh, ours.config, zero3=zero3), ours, mesh)
    ir_theirs = lower(llama_plan(mesh, theirs.config, zero3=zero3), theirs, mesh)
    # Both models' logits are gathered as the LM head returns them (the loss runs on whole rows in
    # eager and Static Eager mode alike: vescale/static/local_loss.py). HF's model
    # body reads the sequence length from the embeddings: its plan keeps them whole there (all-reduced)
    # and splits the sequence at the first layer; every other entry is the same, in the same order.
    zoo_only = ["model.embed_tokens.forward:<out>:0:redist(->S(1),TP)"]
    hf_only = ["model.embed_tokens.forward:<out>:0:redist(->R,TP)", "model.layers.0.forward_pre:<in>:hidden_states:redist(->S(1),TP)"]
    entries = lambda ir: [line for line in str(ir).splitlines() if not line.startswith("#")]  # noqa: E731
    ours_entries, theirs_entries = entries(ir_ours), entries(ir_theirs)
    assert [e for e in ours_entries if e in zoo_only] == zoo_only and [e for e in theirs_entries if e in hf_only] == hf_only
    assert [e for e in ours_entries if e not in zoo_only] == [e for e in theirs_entries if e not in hf_only]
    assert "lm_head.forward:<out>:0:redist(->R,TP)" in str(ir_ours).splitlines(), str(ir_ours)
    text = str(ir_ours).splitlines()
    # Spot checks that follow from the plan's statements and the model's signatures.
    assert "forward_pre:<in>:input_ids:redist(->S(0),DP)" in text
    assert "model.layers.1.self_attn.forward_pre:<in>:hidden_states:redist(->R,TP)" in text
    assert "model.layers.0.mlp.forward_pre:<in>:x:redist(->R,TP)" in text
    assert "lm_head.forward_pre:<in>:input:redist(->R,TP)" in text
    gathers = [line for line in text if ":gather(" in line]
    # The tiny LLaMA has no biases: ZeRO-3's ".*weight" gathers every parameter.
    assert len(gathers) == (len(list(ours.parameters())) if zero3 else 0)


def test_explain_output_in_the_docs_is_current(llamas, mesh):
    """docs/plan.md pastes explain()'s output for the zoo plan; keep it in step with the code."""
    from vescale.zoo import llama_plan

    doc = DOC.read_text()
    start = doc.index("<!-- explain-output -->")
    block = doc[doc.index("```text\n", start) + len("```text\n") : doc.index("```", doc.index("```text\n", start) + 8)]
    ours = llamas[0]
    assert block.rstrip("\n") == str(vescale.explain(ours, llama_plan(mesh, ours.config), mesh))
