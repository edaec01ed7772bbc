"""Test session setup: a fresh block-options cache, and browser fixtures for
pytest-playwright (Debian's chromium, never a downloaded one)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from bench.app import CHROMIUM_ARGS


def pytest_configure(config: pytest.Config) -> None:
    """Options on disk are keyed by the solver code's hash, but a developer's ~/.cache/remat
    may still hold options another checkout computed: every session starts from an empty
    cache of its own (subprocesses, such as the CLI's, inherit it)."""
    os.environ["REMAT_CACHE"] = tempfile.mkdtemp(prefix="remat-cache-")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ["REMAT_CACHE"], ignore_errors=True)


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
