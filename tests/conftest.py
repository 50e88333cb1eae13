"""Suite-wide settings: reproducible Hypothesis runs and tests that leave PyTorch as they found it.

* Hypothesis runs under the ``ci`` profile: ``derandomize=True`` (each property test draws the same
  examples on every run, derived from the test itself, so CI is reproducible and a failure is the
  same failure on the next run) and ``print_blob=True`` (a failure prints the falsifying example
  and a ``@reproduce_failure(...)`` line that replays it). ``pytest --hypothesis-profile explore``
  draws fresh random examples instead (kept in ``.hypothesis/`` for replay), for hunting bugs
  locally; a failure found that way prints its blob too.
* Every test leaves DTensor's thread-local implicit replication (which ``vescale.parallelize``
  switches on for the calling thread, as its contract says) and vescale's extensions of DTensor
  (``vescale.dispatch.install`` / ``vescale.random`` install, both done by ``parallelize``) as it
  found them, so no test passes or fails because of the tests that ran before it in the same
  process (pytest-xdist's ``--dist loadfile`` groups files differently from run to run).
"""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from hypothesis import settings

from vescale import dispatch
from vescale.random import dtensor as random_dtensor

settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("ci")


@contextlib.contextmanager
def _restoring_pytorch():
    implicit = torch._C._get_dtensor_allow_implicit_replication()
    dispatch_installed = dispatch.is_installed()
    random_installed = random_dtensor.is_installed()
    yield
    torch._C._set_dtensor_allow_implicit_replication(implicit)
    if dispatch.is_installed() != dispatch_installed:
        dispatch.install() if dispatch_installed else dispatch.uninstall()
    if random_dtensor.is_installed() != random_installed:
        random_dtensor.install() if random_installed else random_dtensor.uninstall()


def pytest_sessionstart(session):
    """Import, once per test process, what ranks would otherwise import on every launch.

    ``run_on_ranks`` forks its ranks from the test process, so they inherit its imports. HF's and
    diffusers' model code is imported lazily (``vescale.zoo`` builds the models on demand), and a
    rank that builds an HF model would import it afresh: ~2.7 s of CPU per rank per launch (11 s for
    4 ranks, against 0.2 s with it imported in the parent). Building each tiny zoo model once here
    imports all of it; the generators are left as they were. (Not in pytest-xdist's controller,
    which runs no test.)"""
    if getattr(session.config, "workerinput", None) is None and session.config.getoption("numprocesses", None):
        return
    try:
        from vescale import zoo
        from vescale.testing import forget_dtensor_caches
    except ImportError:
        return
    with torch.random.fork_rng(devices=[]):
        for build in (zoo.tiny_hf_llama, zoo.tiny_hf_mixtral, zoo.tiny_hf_qwen3_moe, zoo.tiny_hf_gpt2, zoo.tiny_dit):
            try:
                build()
            except ImportError:  # transformers / diffusers not installed: their tests skip
                pass
    forget_dtensor_caches()  # imports DTensor's debug and redistribute modules, which each rank clears
    # What was imported lives as long as the process: out of the garbage collector's sight (full
    # collections in tests and in forked ranks do not walk it).
    gc.collect()
    gc.freeze()


# Module scope too: a module-scoped fixture (a model parallelised once for a file's tests) changes
# the state after the first test's snapshot; this restores it when the module ends.
@pytest.fixture(autouse=True, scope="module")
def _module_leaves_pytorch_as_found():
    with _restoring_pytorch():
        yield


@pytest.fixture(autouse=True)
def _test_leaves_pytorch_as_found():
    with _restoring_pytorch():
        yield


# The long suite (``pytest -m slow``): variants whose mechanism a faster test in the default run
# already covers (another mesh or mode of the same equivalence), and whole-process fault drills.
# Each entry: node id -> the default-run test that covers it. Keeps CI (fresh 2-core clone,
# install included) under 15 minutes; run the long suite before a release or a risky merge.
LONG_SUITE = {
    "tests/checkpoint/test_restart.py::test_killed_rank_restarts_and_resumes_with_identical_losses":
        "torchrun kill -9 + restart drill (resume bit for bit: tests/checkpoint/test_resume.py)",
    "tests/static/test_static_resize.py::test_derived_record_is_bit_for_bit_a_recorded_one_dp2tp2_zero3":
        "test_derived_record_is_bit_for_bit_a_recorded_one_tp2",
    "tests/static/test_static_resize.py::test_new_batch_and_length_together_dp2tp2_zero3":
        "test_training_over_new_lengths_reuses_records[TP=2+SP]",
    "tests/static/test_static_resize.py::test_training_over_new_lengths_reuses_records[DP=2xTP=2+SP+ZeRO-3]":
        "its TP=2+SP variant",
    "tests/zoo/test_llama_rng.py::test_init_and_dropout_training_match_single_device[TP=2]": "its DP=2xTP=2+SP variant",
    "tests/zoo/test_llama_rng.py::test_init_and_dropout_training_match_single_device[TP=4]": "its DP=2xTP=2+SP variant",
    "tests/debug/test_breakpoint.py::test_two_ranks_under_torchrun": "test_four_ranks_two_debugged (forked ranks)",
    "tests/static/test_static_moe.py::test_static_moe_matches_eager_and_single_device[DP=1xTP=2+SP]":
        "its DP=2xTP=2+SP+ZeRO-3 variant",
    "tests/static/test_static_moe.py::test_static_moe_matches_eager_and_single_device[TP=2+SP]": "its DP=2xTP=2+SP+ZeRO-3 variant",
    "tests/static/test_static_llama.py::test_static_two_ranks_matches_eager_and_single_device":
        "test_static_four_ranks_matches_eager_and_single_device",
    "tests/static/test_static_checkpointing.py::test_static_checkpointing_on_tp_sp_matches_eager_and_single_device":
        "its DP x TP + ZeRO-3 variant",
    "tests/static/test_static_hotpath.py::test_static_hot_path_matches_eager[DP=2xTP=2+SP+ZeRO-3]":
        "its TP=2+SP variant; ZeRO-3's parameter hooks: tests/parallel/test_zero3.py (own_hooks)",
    "tests/optim/test_flat_optim_training.py::test_flat_steps_in_training_equal_per_tensor_steps[static-False]":
        "its static-True and eager-False variants",
    "tests/optim/test_flat_optim_training.py::test_flat_steps_in_training_equal_per_tensor_steps[eager-True]":
        "its static-True and eager-False variants",
    "tests/zoo/test_ignored_labels.py::test_unevenly_ignored_labels_give_the_single_device_loss[hf]": "its [ours] variant",
    "tests/static/test_static_llama.py::test_static_four_ranks_matches_eager_and_single_device":
        "test_static_equal.py (static == eager bit for bit, DP=2xTP=2+SP+ZeRO-3), test_llama_parallel.py (eager vs one device)",
    "tests/parallel/test_exit.py::test_a_run_exits_cleanly":
        "test_examples.py::test_demo_script_runs_short (a 4-rank torchrun that must exit 0); the 50-run loop beside it",
    "tests/comm/test_layout_scale.py::test_plans_equal_the_exhaustive_computation[3]": "its seeds 0-2",
    "tests/comm/test_layout_scale.py::test_plans_equal_the_exhaustive_computation[4]": "its seeds 0-2",
    "tests/comm/test_layout_scale.py::test_plans_equal_the_exhaustive_computation[5]": "its seeds 0-2",
    "tests/static/test_static_equal.py::test_more_static_steps_equal_eager_steps_bit_for_bit[hf-llama]":
        "its [llama] variant (the zoo LLaMA: the same layers)",
    "tests/static/test_static_equal.py::test_more_static_steps_equal_eager_steps_bit_for_bit[qwen3-moe]":
        "its [mixtral] variant (the same MoE plan)",
    # Static Eager's fast paths against their general path, bit for bit (a reference path kept for
    # these tests): test_static_equal.py holds every fast path on against eager mode, bit for bit.
    "tests/static/test_static_units.py::test_units_match_per_member_hooks_bit_for_bit":
        "test_static_equal.py (ZeRO-3 units on, DP=2xTP=2+SP+ZeRO-3, static == eager bit for bit)",
    "tests/static/test_static_root.py::test_root_moves_match_the_general_path_bit_for_bit":
        "test_static_equal.py (root moves on, static == eager bit for bit)",
    "tests/static/test_static_quiet.py::test_quiet_modules_match_hooked_training_bit_for_bit":
        "test_static_equal.py (quiet modules on, static == eager bit for bit)",
    "tests/static/test_static_zoo.py::test_zoo_model_runs_static_and_matches_one_device[llama-DP]":
        "its [llama-TP] variant; static on DP=2xTP=2+ZeRO-3: test_static_equal.py[llama]",
    "tests/static/test_static_zoo.py::test_zoo_model_runs_static_and_matches_one_device[gpt2-DP]":
        "its [gpt2-TP] variant; static on DP=2xTP=2+ZeRO-3: test_static_equal.py[gpt2]",
    "tests/static/test_static_zoo.py::test_zoo_model_runs_static_and_matches_one_device[dit-DP]":
        "its [dit-TP] variant; static on DP=2xTP=2+ZeRO-3: test_static_equal.py[dit]",
    "tests/comm/test_layout_scale.py::test_plans_equal_the_exhaustive_computation[1]": "its seed 0",
    "tests/comm/test_layout_scale.py::test_plans_equal_the_exhaustive_computation[2]": "its seed 0",
    "tests/parallel/test_zero3.py::test_keeping_the_last_unit_changes_no_result[eager]":
        "its [static] variant (the same scheduler option)",
    "tests/random/test_multiproc_rng.py::test_every_op_matches_single_device_on_real_ranks[(2,)]":
        "its [(4,)] and [(2, 2)] variants",
    "tests/checkpoint/test_resume.py::test_resume_tp2": "test_resume_dp2_tp2_zero3 (TP with DP and ZeRO-3)",
}


# The files that take longest (seconds of one worker, a shuffled run of 2026-11-29), run first:
# pytest-xdist's --dist loadfile hands files out in collection order, so a long file collected
# last would leave the other worker idle while it runs. Heaviest first, the last files are short
# and both workers end together. Order does not change results (the suite passes shuffled).
HEAVY_FILES = {
    "tests/static/test_static_equal.py": 180, "tests/fuzz/test_fuzz.py": 177, "tests/zoo/test_moe_parallel.py": 130,
    "tests/examples/test_examples.py": 112, "tests/static/test_static_llama.py": 106, "tests/docs/test_doc_blocks.py": 103,
    "tests/comm/test_layout_scale.py": 95, "tests/zoo/test_llama_parallel.py": 79, "tests/static/test_static_resize.py": 76,
    "tests/parallel/test_faults.py": 73, "tests/static/test_static_embedding.py": 63, "tests/zoo/test_dit_parallel.py": 63,
    "tests/random/test_multiproc_rng.py": 60, "tests/static/test_static_moe.py": 59, "tests/static/test_static_units.py": 57,
}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -HEAVY_FILES.get(item.nodeid.split("::", 1)[0], 0))  # stable: the rest keep their order
    found = set()
    for item in items:
        if item.nodeid in LONG_SUITE:
            item.add_marker(pytest.mark.slow)
            found.add(item.nodeid)
    # Only when the whole suite is collected: a renamed test must not silently leave the list.
    if len(items) > 1000 and found != set(LONG_SUITE):
        raise pytest.UsageError(f"tests/conftest.py LONG_SUITE names tests that do not exist: {sorted(set(LONG_SUITE) - found)}")
    files = {item.nodeid.split("::", 1)[0] for item in items}
    if len(items) > 1000 and not set(HEAVY_FILES) <= files:
        raise pytest.UsageError(f"tests/conftest.py HEAVY_FILES names files that do not exist: {sorted(set(HEAVY_FILES) - files)}")
