"""The Plan API on its own: what VescalePlan records, what it rejects at once, and init_mesh's checks.

Nothing here needs a model; lowering against models lives in test_lowering.py.
"""

import pytest
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import vescale
from vescale import INIT, RUN, VescalePlan
from vescale.plan import Statement


# ---------------------------------------------------------------------------------------------
# What a plan records
# ---------------------------------------------------------------------------------------------


def test_statements_are_kept_verbatim_in_order():
    plan = VescalePlan()
    returned = plan.shard(r"fc\.weight", Shard(0), mesh="TP").shard(r".*bias", [Replicate(), Shard(0)])
    plan.factory(r"rope", Replicate(), mesh="TP")
    assert returned is plan  # calls chain
    first, second, third = plan.statements
    assert (first.kind, first.path, first.placements, first.mesh_dim, first.phase, first.index) == (
        "shard", r"fc\.weight", (Shard(0),), "TP", None, 0
    )
    assert second.placements == (Replicate(), Shard(0)) and second.mesh_dim is None and second.index == 1
    assert (third.kind, third.path, third.index) == ("factory", "rope", 2)


def test_statement_str_quotes_the_call():
    plan = VescalePlan()
    plan.shard(r"fc\.weight", Shard(0), mesh="DP", phase=INIT)
    plan.shard("w", [Replicate(), Partial()])
    plan.factory("rope", Shard(1), mesh="TP")
    assert [str(s) for s in plan.statements] == [
        r"#0 plan.shard('fc\\.weight', S(0), mesh='DP', phase=INIT)",
        "#1 plan.shard('w', R, P(sum))",
        "#2 plan.factory('rope', S(1), mesh='TP')",
    ]
    assert repr(plan).splitlines()[1:-1] == [f"  {s}" for s in plan.statements]
    assert repr(VescalePlan()) == "VescalePlan()"


@pytest.mark.parametrize(
    "path, activation, module_pattern",
    [  # module_pattern: the regex over activation paths ("mlp.<in>", "<in>" for the root), key left out
        (r"fc\.weight", None, r"fc\.weight"),
        ("<in>", ("in", None), "<in>"),
        (r"mlp\.<in>", ("in", None), r"mlp\.<in>"),
        ("mlp.<in>", ("in", None), "mlp.<in>"),  # an unescaped dot is accepted too
        (r"layers\.\d+\.attn\.<in>[0]", ("in", "0"), r"layers\.\d+\.attn\.<in>"),
        (r"attn\.<in>\[hidden_states\]", ("in", "hidden_states"), r"attn\.<in>"),
        (r"(mlp|attn)\.<out>", ("out", None), r"(mlp|attn)\.<out>"),
        (r"lm_head\.<out>[1]", ("out", "1"), r"lm_head\.<out>"),
        (r"<out>[logits]", ("out", "logits"), "<out>"),
        (r".*<in>", ("in", None), ".*<in>"),  # no separator needed: the whole path is one regex
    ],
)
def test_activation_paths_split_into_module_pattern_and_key(path, activation, module_pattern):
    st = VescalePlan().shard(path, Replicate(), mesh="TP").statements[0]
    assert st.activation == activation
    if activation is not None:
        assert st.module_pattern == module_pattern


def test_factory_path_is_a_module_pattern():
    st = VescalePlan().factory(r"model\.rotary_emb", Replicate(), mesh="TP").statements[0]
    assert st.kind == "factory" and st.module_pattern == r"model\.rotary_emb"


def test_phases():
    assert vescale.INIT is INIT and vescale.RUN is RUN and INIT is not RUN
    assert repr(INIT) == "INIT" and repr(RUN) == "RUN"
    plan = VescalePlan().shard("w", Shard(0), mesh="DP", phase=INIT).shard("w", Replicate(), mesh="DP", phase=RUN)
    assert [s.phase for s in plan.statements] == [INIT, RUN]


# ---------------------------------------------------------------------------------------------
# What a plan rejects at once (before it ever sees a model)
# ---------------------------------------------------------------------------------------------


def test_bad_regex_names_the_path():
    with pytest.raises(ValueError, match=r"plan.shard: path 'fc\(' is not a valid regular expression"):
        VescalePlan().shard("fc(", Shard(0), mesh="TP")
    with pytest.raises(ValueError, match=r"plan.factory: path '\[' is not a valid regular expression"):
        VescalePlan().factory("[", Replicate())


@pytest.mark.parametrize("path", ["", None, 3])
def test_path_must_be_a_non_empty_string(path):
    with pytest.raises(TypeError, match="path must be a non-empty regular expression string"):
        VescalePlan().shard(path, Shard(0), mesh="TP")


def test_factory_accepts_the_root_module_path():
    assert VescalePlan().factory("", Replicate(), mesh="TP").statements[0].module_pattern == ""


@pytest.mark.parametrize("placement", ["S(0)", [], [Shard(0), "R"]])
def test_bad_placement_type(placement):
    with pytest.raises(TypeError, match=r"plan path 'w': placement must be a Shard/Replicate/Partial"):
        VescalePlan().shard("w", placement)


@pytest.mark.parametrize("placement", [0, None, Shard], ids=["int", "None", "Shard-class"])
def test_non_iterable_placement_gets_the_clear_message(placement):
    with pytest.raises(TypeError, match=r"plan path 'w': placement must be a Shard/Replicate/Partial"):
        VescalePlan().shard("w", placement, mesh="TP")


def test_phase_must_be_init_or_run():
    with pytest.raises(TypeError, match=r"plan path 'w': phase must be vescale.INIT or vescale.RUN, got 'INIT'"):
        VescalePlan().shard("w", Shard(0), mesh="DP", phase="INIT")


@pytest.mark.parametrize("path", [r"mlp\.<in>", "<in>[x]", r"mlp\.<out>[0]"])
def test_phase_on_an_activation_is_rejected(path):
    with pytest.raises(ValueError, match="phase applies to parameters and buffers, not to activations"):
        VescalePlan().shard(path, Replicate(), mesh="TP", phase=RUN)


def test_mesh_with_a_list_of_placements_is_rejected():
    with pytest.raises(ValueError, match=r"with mesh='TP' give one placement, not 2; omit mesh"):
        VescalePlan().shard("w", [Shard(0), Replicate()], mesh="TP")
    # One placement in a list is one placement.
    assert VescalePlan().shard("w", [Shard(0)], mesh="TP").statements[0].placements == (Shard(0),)


def test_mesh_must_be_a_dimension_name():
    with pytest.raises(TypeError, match=r"mesh must name a mesh dimension \(a string\), got 1"):
        VescalePlan().shard("w", Shard(0), mesh=1)


def test_a_rejected_statement_is_not_recorded():
    plan = VescalePlan().shard("w", Shard(0), mesh="TP")
    with pytest.raises(ValueError):
        plan.shard("(", Shard(0), mesh="TP")
    with pytest.raises(ValueError):
        plan.shard("<in>", Shard(0), mesh="TP", phase=INIT)
    assert len(plan.statements) == 1
    assert plan.shard("v", Shard(0), mesh="TP").statements[-1].index == 1  # indices stay dense


def test_statement_is_immutable():
    st = VescalePlan().shard("w", Shard(0), mesh="TP").statements[0]
    assert isinstance(st, Statement)
    with pytest.raises(AttributeError):
        st.path = "v"


# ---------------------------------------------------------------------------------------------
# init_mesh: its checks, and a mesh over an existing (here: fake) process group
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, names, message",
    [
        ((2, 2), ("DP",), r"shape \(2, 2\) has 2 dimensions but names \('DP',\) has 1"),
        ((2, 2), ("DP", "DP"), "dimension names must be distinct non-empty strings"),
        ((2,), ("",), "dimension names must be distinct non-empty strings"),
        ((2, 0), ("DP", "TP"), r"every mesh dimension needs at least one rank, got \(2, 0\)"),
    ],
)
def test_init_mesh_rejects_bad_shapes_and_names(shape, names, message):
    with pytest.raises(ValueError, match=message):
        vescale.init_mesh(shape, names, device_type="cpu")


def test_init_mesh_uses_the_existing_process_group(fake_world):
    mesh = vescale.init_mesh((2, 2), ("DP", "TP"), device_type="cpu")
    assert mesh.mesh_dim_names == ("DP", "TP") and tuple(mesh.shape) == (2, 2)
    assert dist.get_backend() == "fake"  # not replaced by a new group
    with pytest.raises(ValueError, match=r"mesh shape \(2,\) holds 2 ranks but the run has 4"):
        vescale.init_mesh((2,), ("DP",), device_type="cpu")
