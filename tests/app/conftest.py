"""Browser tests wait on page state with generous limits: on a loaded 2-core machine a page
update that takes 0.3 s idle took 30 s and more (issue 36: a 30 s `wait_for_function`
failed a CI run). A limit only ends a test that is already failing, so it can be long."""

from __future__ import annotations

import pytest

PAGE_TIMEOUT_MS = 180_000


@pytest.fixture
def page(page):
    """pytest-playwright's page, with every wait's default limit at `PAGE_TIMEOUT_MS`."""
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    return page
