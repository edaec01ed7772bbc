"""What the app keeps between requests: analysed problems, plans and trade-off curves.

Everything lives in this process (a `Problem` holds traced ATen ops, which do not pickle), so
serve with one worker process and several threads. Analysing a model takes seconds to a
minute and its `Problem` can hold hundreds of MB of graph for big models, so at most
`PROBLEMS` (4) problems are kept, least recently used first out. Plans are cheap to redo
but sit on the slider's path, so the last `PLANS` (64) are kept.

Background callbacks: Dash's `DiskcacheManager` runs each job in a child process, whose
results would have to be pickled back. `ThreadedDiskcacheManager` keeps Dash's machinery
(diskcache for results and progress, polling, `running`, `cancel`) but runs the job in a
thread of this process, so the problem it analyses lands in the cache the other callbacks read.

Dash keys a job's result by a hash of the callback's source and arguments, and deletes the
result when the first page reads it. Pages that open on the same model send the same
arguments, so they shared one result slot: the first page to poll took it and the others
waited for good on "Analysing the model…". Each job here gets a key of its own.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from dash import DiskcacheManager

from core import Interrupted, stop_when

PROBLEMS = 4
PLANS = 64
DERIVED = 64


class LRU:
    """A thread-safe least-recently-used map with at most `size` entries."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"an LRU holds at least one entry, not {size}")
        self.size = size
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.RLock()
        self._key_locks: dict[Hashable, threading.Lock] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._data

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._data)

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            if key not in self._data:
                return default
            self._data.move_to_end(key)
            return self._data[key]

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.size:
                self._data.popitem(last=False)

    def get_or_make(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The cached value, or `make()` stored; two threads asking for one key make it once."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._data:
                    return self._data[key]
            value = make()
            self.put(key, value)
            with self._lock:
                self._key_locks.pop(key, None)
            return value


_job_state = threading.local()


def check_cancelled() -> None:
    """Raise `Interrupted` inside a background job whose page cancelled it (a new model was
    chosen meanwhile)."""
    event = getattr(_job_state, "cancel", None)
    if event is not None and event.is_set():
        raise Interrupted("cancelled by the page")


def job_name(context: Any) -> str:
    """A job thread's name: "remat-background" and the id of the first output it draws (what
    a stack dump or a test tells jobs apart by)."""
    outputs = context.get("outputs_list") if isinstance(context, dict) else None
    while isinstance(outputs, list) and outputs:
        outputs = outputs[0]
    if isinstance(outputs, dict) and isinstance(outputs.get("id"), str):
        return f"remat-background {outputs['id']}"
    return "remat-background"


class ThreadedDiskcacheManager(DiskcacheManager):
    """Dash's diskcache background manager, running each job in a thread of this process."""

    def __init__(self, cache=None) -> None:
        super().__init__(cache)
        self._jobs: dict[int, tuple[threading.Thread, threading.Event]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def build_cache_key(self, fn, args, cache_args_to_ignore, triggered) -> str:
        """Dash's key plus a fresh nonce: one result slot per job, never shared by pages."""
        base = super().build_cache_key(fn, args, cache_args_to_ignore, triggered)
        return f"{base}-{uuid.uuid4().hex}"

    def call_job_fn(self, key, job_fn, args, context):
        cancel = threading.Event()

        def run() -> None:
            _job_state.cancel = cancel
            try:  # a solve in progress (an ILP of minutes) stops too, not only between solves
                with stop_when(cancel.is_set):
                    job_fn(key, self._make_progress_key(key), args, context)
            finally:
                _job_state.cancel = None

        thread = threading.Thread(target=run, daemon=True, name=job_name(context))
        with self._lock:
            job = next(self._ids)
            self._jobs[job] = (thread, cancel)
        thread.start()
        return job

    def job_running(self, job) -> bool:
        with self._lock:
            entry = self._jobs.get(int(job))
        return entry is not None and entry[0].is_alive()

    def terminate_job(self, job) -> None:
        if job is None:
            return
        with self._lock:
            entry = self._jobs.pop(int(job), None)
        if entry is not None:
            entry[1].set()  # threads cannot be killed: the job checks this and stops

    def terminate_unhealthy_job(self, job) -> bool:
        return False

    def stop_all(self, timeout: float = 60.0) -> None:
        """Ask every job to stop and wait for them, `timeout` seconds in all: a server shut
        down leaves no analysis running in the process that served it."""
        with self._lock:
            jobs = list(self._jobs.values())
            self._jobs.clear()
        for _, cancel in jobs:
            cancel.set()
        deadline = time.monotonic() + timeout
        for thread, _ in jobs:
            thread.join(max(0.0, deadline - time.monotonic()))
