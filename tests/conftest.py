"""Test session setup: a fresh block-options cache, sample models analysed once a session,
the browser tests marked slow, and browser fixtures for pytest-playwright (Debian's chromium,
never a downloaded one)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import serve_in_thread
from torch import nn

import core
from app.server import create_app
from bench.app import CHROMIUM_ARGS
from core.problem import Problem
from sample_models import build

Analysed = tuple[nn.Module, tuple[torch.Tensor, ...], Problem]


def pytest_configure(config: pytest.Config) -> None:
    """Options on disk are keyed by the solver code's hash, but a developer's ~/.cache/remat
    may still hold options another checkout computed: every session starts from an empty
    cache of its own (subprocesses, such as the CLI's, inherit it)."""
    os.environ["REMAT_CACHE"] = tempfile.mkdtemp(prefix="remat-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ["REMAT_CACHE"], ignore_errors=True)


# Tests the fast tier leaves out besides those marked at their definition: each took 2-12 s
# in a full run on this 2-core machine (2026-11-25, `pytest --durations`), mostly subprocesses,
# whole-graph ILPs and the larger zoo models. `make test` runs them all.
SLOW_TESTS = {
    "test_solvers.py::test_first_highs_solve_prints_nothing_to_stdout",
    "test_solvers.py::test_block_option_bounds_are_deterministic_and_noted",
    "test_solvers.py::test_chain_plans_run_as_predicted[gpt-1layer-rockmate]",
    "test_solvers.py::test_keep_set_search_stops_at_its_state_bound_and_says_so",
    "test_imports.py::test_each_module_imports_alone",
    "test_errors.py::test_cli_builder_that_raises_or_exits_is_named",
    "test_errors.py::test_cli_debug_shows_traceback",
    "test_moe.py::test_default_grouped_mm_experts_plan_and_run_exactly",
    "test_app.py::test_app_reads_back_an_offload_plan",
    "test_app.py::test_measure_here_runs_the_real_step_and_reads_it_back_per_program_step",
    "test_tampered_plans.py::test_tampered_programs_in_files",
    "test_nested.py::test_nested_options_run_the_blocks_forward_once_and_go_below_the_keep_set_search",
    "test_zoo.py::test_zoo_plans_are_exact_with_keywords_and_an_outside_loss[hf-llama]",
    "test_zoo.py::test_zoo_plans_are_exact_with_keywords_and_an_outside_loss[hf-vit]",
    "test_zoo.py::test_the_plain_benchmarks_do_not_import_transformers",
    "test_minimum.py::test_the_ilp_minimum_solves",
    "test_offload.py::test_a_solved_vit_plan_offloads_and_runs_as_predicted",
    "test_cli_models.py::test_console_script_imports_a_model_module_from_the_working_directory",
    "test_cli_models.py::test_a_missing_model_module_says_where_it_looked",
    "test_cli_models.py::test_a_missing_dependency_of_the_model_module_is_named",
    "test_storage_sizes.py::test_a_loss_fn_runs_at_its_predicted_peak[bce]",
    "test_solvers.py::test_whole_graph_ilp_reports_a_real_minimum",
    "test_offload.py::test_the_greedy_pass_figures_every_try_as_the_walk_does[gpt-tiny-h100]",
    "test_costs.py::test_identical_layers_are_timed_once",
    "test_tampered_plans.py::test_edited_graph_metadata",
    "test_zoo.py::test_zoo_offload_plans_are_exact_and_round_trip[hf-llama]",
    "test_reorder.py::test_reordered_plans_run_with_eager_gradients_and_the_predicted_peak"
    "[regnet-tiny-rockmate-None]",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Browser tests and SLOW_TESTS are slow tests: `pytest -m "not slow"` leaves them out."""
    for item in items:
        name = f"{item.path.name}::{item.name}"
        if item.get_closest_marker("browser") is not None or name in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def analysed() -> Callable[..., Analysed]:
    """`analysed(name, device="cpu")`: a sample model, its inputs and its Problem (estimated
    costs on `device`'s preset), analysed once a session. Shared by every test that asks:
    read them, solve and simulate, run steps from zeroed gradients (the plans then run on the
    model analysed, without a retrace); never train the model, change its buffers or edit the
    problem, and count on no solver work being fresh (solvers memoise per problem). A test
    that needs any of that builds and analyses its own."""
    done: dict[tuple[str, str], Analysed] = {}

    def get(name: str, device: str = "cpu") -> Analysed:
        if (name, device) not in done:
            model, inputs = build(name)
            done[name, device] = (model, inputs, core.analyze(model, inputs, device=device))
        return done[name, device]

    return get


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The test on 1 thread (restored after). Bit-identical gradients are held on 1 thread:
    on 2, Mixtral's expert weights came out 4.7e-10 off eager's in one store_all run (a
    kernel's work split across threads), while eager repeated on 2 threads was stable: not
    yet explained, left for a GPU/threads check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """The app served in a thread for a module's browser tests (a module may define its own,
    e.g. with extra models)."""
    address, stop = serve_in_thread(create_app())
    yield address
    stop()


def chromium_path() -> str | None:
    return shutil.which("chromium") or (
        "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None
    )


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args):
    path = chromium_path()
    if path is None:
        message = (
            "Debian's chromium is missing: `apt-get install chromium chromium-driver` "
            "(or `make browser` as root)"
        )
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message)
        pytest.skip(message)
    return {**browser_type_launch_args, "executable_path": path, "args": CHROMIUM_ARGS}
