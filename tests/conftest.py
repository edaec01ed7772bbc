"""Browser fixtures for pytest-playwright: Debian's chromium, never a downloaded one."""

from __future__ import annotations

import os
import shutil

import pytest

from app.bench import CHROMIUM_ARGS


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
