"""Build and serve the app: `remat app` calls `serve`."""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import dash
import diskcache

from app import callbacks
from app.cache import ThreadedDiskcacheManager
from app.layout import build_layout
from app.models import resolve_builder
from app.state import DEFAULT_MODEL, DEFAULT_OFFLOAD, Studio
from core import RematError


class ServeError(RematError):
    """The app cannot be served as asked: a port out of range or already in use."""


log = logging.getLogger(__name__)

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def create_app(
    extra_models: dict[str, Callable] | None = None,
    *,
    initial_model: str | None = None,
    startup_error: str = "",
    warm: bool = True,
    offload_method: str = DEFAULT_OFFLOAD,
) -> dash.Dash:
    """The Dash app over the sample models plus `extra_models` (name -> () -> (model, inputs)).

    It opens on `initial_model` (default gpt-tiny); `startup_error` is shown at the top of the
    page (a `--model` that failed to load). With `warm`, the first model is analysed in a
    thread right away, so the page is usable sooner. The offload switch re-solves with
    `offload_method` ("offload", or another offloading method `core.solve` knows).
    """
    studio = Studio(extra_models, offload_method)
    model = initial_model if initial_model in studio.builders else DEFAULT_MODEL
    manager = ThreadedDiskcacheManager(diskcache.Cache(tempfile.mkdtemp(prefix="remat-app-")))
    app = dash.Dash(
        __name__,
        title="Remat Studio",
        assets_folder=str(ASSETS),
        background_callback_manager=manager,
        update_title=None,  # type: ignore[arg-type]  # None: keep the title while updating
    )
    method = studio.default_method()
    app.layout = build_layout(
        list(studio.builders), model, method, [method], startup_error=startup_error
    )
    callbacks.register(app, studio)
    app.studio = studio  # type: ignore[attr-defined]  # for tests and the benchmark
    app.jobs = manager  # type: ignore[attr-defined]  # `app.jobs.stop_all()` after serving
    if warm:
        key = studio.key(model, "estimated", "cpu")
        threading.Thread(target=_quietly, args=(studio.problem, key), daemon=True).start()
    return app


def serve(
    host: str = "127.0.0.1",
    port: int = 8050,
    model: str | None = None,
    debug: bool = False,
    offload_method: str = DEFAULT_OFFLOAD,
    models: Sequence[str] = (),
) -> None:
    """Serve the app on http://host:port/, with `model` and `models` ("package.module:callable"
    returning (model, example_inputs)) added to the menu, opened on the first of them or on
    gpt-tiny; its offload switch re-solves with `offload_method`."""
    check_port(host, port)
    extra = extra_models([*([model] if model else []), *models])
    initial = next(iter(extra), None)
    app = create_app(extra, initial_model=initial, offload_method=offload_method)
    print(f"Remat Studio: http://{host}:{port}/", flush=True)
    app.run(host=host, port=port, debug=debug)


def extra_models(specs: Sequence[str]) -> dict[str, Callable]:
    """The builders of `specs` ("package.module:callable"), by name, in order; a wrong one is
    an error (ModelSpecError), not a silent fallback. Each is resolved here, at start-up, so
    nothing typed in the page ever imports code."""
    return {spec: resolve_builder(spec) for spec in dict.fromkeys(specs)}


def check_port(host: str, port: int) -> None:
    """Refuse a port out of range or in use now, with a ServeError, rather than let the server
    abort (a port over 65535) or exit 1 with its own message (a port in use)."""
    if type(port) is not int or not 0 <= port <= 65535:
        raise ServeError(f"port {port!r} is not a TCP port (0-65535): choose one with --port")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ServeError(
                f"cannot serve on {host}:{port}: {e.strerror}: choose another port with --port"
            ) from None


def _quietly(fn: Callable, *args: Any) -> None:
    """`fn(*args)` in a warm-up thread: a failure is logged, not raised (the page shows the
    error in its own words when it asks for the same model)."""
    try:
        fn(*args)
    except Exception:
        log.warning("warming up with %s%r failed", getattr(fn, "__name__", fn), args, exc_info=True)
