"""Stopping a long solve from outside it: the app stops the job of a page that moved on.

A trade-off curve's whole-graph ILP can run for minutes on a small model; a job that only
checks between solves keeps a core busy that long after its page chose another model.
`stop_when` names, for the calling thread, a condition that the solvers poll: HiGHS at each of
its interrupt callbacks (simplex, interior point, branch and bound), so the ILP returns within
a fraction of a second and `Interrupted` is raised in place of its result; the keep-set search
(`core.solvers.keep_sets`, seconds a block on the U-Nets) before each simulation. Nothing is
memoised from a stopped solve. CBC runs as a subprocess and is not stopped early.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from core.errors import Interrupted

_local = threading.local()


@contextmanager
def stop_when(should_stop: Callable[[], bool]) -> Iterator[None]:
    """Within the block, on this thread, a solve stops and raises `Interrupted` soon after
    `should_stop()` turns true."""
    outer = getattr(_local, "should_stop", None)
    _local.should_stop = should_stop
    try:
        yield
    finally:
        _local.should_stop = outer


def stop_condition() -> Callable[[], bool] | None:
    """The condition `stop_when` set on this thread, if any."""
    return getattr(_local, "should_stop", None)


def stop_if_asked() -> None:
    """Raise `Interrupted` when this thread's `stop_when` condition holds: what a solver's own
    search loop calls between its steps."""
    should_stop = stop_condition()
    if should_stop is not None and should_stop():
        raise Interrupted("the solve stopped: the caller asked (core.stop_when)")
