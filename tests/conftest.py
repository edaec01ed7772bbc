"""Test session setup: a fresh block-options cache, sample models analysed once a session,
browser tests marked slow, and browser fixtures for pytest-playwright (Debian's chromium,
never a downloaded one)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest
import torch
from dash import Dash
from helpers import serve_in_thread, untraceable
from playwright.sync_api import Browser, Page
from torch import nn

import core
from app.server import create_app
from app.state import DEFAULT_MODEL
from bench.app import CHROMIUM_ARGS
from core.problem import Problem
from sample_models import build

Analysed = tuple[nn.Module, tuple[torch.Tensor, ...], Problem]


def pytest_configure(config: pytest.Config) -> None:
    """Options on disk are keyed by the solver code's hash, but a developer's ~/.cache/remat
    may still hold options another checkout computed: every session starts from an empty
    cache of its own, which its xdist workers share (they inherit the controller's
    environment; entries are written whole and renamed into place) and subprocesses, such
    as the CLI's, inherit."""
    if not hasattr(config, "workerinput"):  # the controller, or a run without xdist
        os.environ["REMAT_CACHE"] = tempfile.mkdtemp(prefix="remat-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["REMAT_CACHE"], ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Browser tests are slow tests: `pytest -m "not slow"` leaves them out, with every test
    marked `slow` at its definition (each took 2-12 s in a full run on this 2-core machine)."""
    for item in items:
        if item.get_closest_marker("browser") is not None:
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


_SHARED: list[Dash] = []  # the session's app, once `url` serves it


@pytest.fixture(scope="session")
def url() -> Iterator[str]:
    """The app served in a thread, one per test process, for every browser test module that
    does not define its own (one that patches the app or needs it cold does): each model is
    analysed and its curves drawn once a process, not once a module. Its menu has the sample
    models and `untraceable`, a model whose analysis fails."""
    app = create_app({"untraceable": untraceable})
    # What the first page asks first, made before any page waits for it: gpt-tiny's analysis
    # and its least budget (the block options). With two fresh-clone runs, a CPU-bound process
    # and other work on 2 cores (load 19), the first page of a process waited past 300 s for
    # them (ci16, 2026-11-28); here no page timeout runs.
    studio = app.studio  # type: ignore[attr-defined]
    key = studio.key(DEFAULT_MODEL, "estimated", "cpu")
    studio.strategies(key)
    studio.minimum(key, studio.default_method())
    address, stop = serve_in_thread(app)
    _SHARED.append(app)
    yield address
    stop()


@pytest.fixture(autouse=True)
def _jobs_end_with_their_test() -> Iterator[None]:
    """The background jobs a test's pages started on the shared app are stopped when the test
    ends (after its page closed: an autouse fixture is set up first, torn down last). Left
    running, a page's batch chart or curves for a big model held the next tests' pages from
    loading for minutes in a loaded CI run."""
    yield
    for app in _SHARED:
        app.jobs.stop_all()  # type: ignore[attr-defined]


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


@pytest.fixture(scope="session")
def _pages() -> dict[str, Page]:
    """The page a test process's browser tests share (see `page`)."""
    return {}


@pytest.fixture
def page(_pages: dict[str, Page], browser: Browser, browser_context_args: dict) -> Iterator[Page]:
    """One browser page a test process, navigated afresh by each browser test: a page opens
    the app on a cached model in about 1 s where a new page (or context) took 3 s, the
    renderer's caches warm (pytest-playwright makes a context a test). The app keeps nothing
    in cookies or web storage, and each test starts with a `goto`, so tests share no app
    state; after each, the page leaves the app (its polls end before the test's jobs are
    stopped), its viewport and routes are reset, and a page that broke is replaced."""
    shared = _pages.get("page")
    if shared is None or shared.is_closed():
        shared = _pages["page"] = browser.new_context(**browser_context_args).new_page()
    viewport = shared.viewport_size
    yield shared
    try:
        shared.unroute_all()
        shared.goto("about:blank")
        if viewport is not None:
            shared.set_viewport_size(viewport)
    except Exception:  # a crashed or wedged page: the next test gets a new one
        shared.context.close()
        _pages.pop("page", None)
