"""Build and serve the app: `remat app` calls `serve`."""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import dash
import diskcache

from app import callbacks
from app.cache import ThreadedDiskcacheManager
from app.layout import build_layout
from app.state import DEFAULT_MODEL, Studio
from core.model_spec import ModelSpecError, resolve_builder

ASSETS = Path(__file__).resolve().parent.parent / "assets"


def create_app(
    extra_models: dict[str, Callable] | None = None,
    *,
    initial_model: str | None = None,
    startup_error: str = "",
    warm: bool = True,
) -> dash.Dash:
    """The Dash app over the sample models plus `extra_models` (name -> () -> (model, inputs)).

    It opens on `initial_model` (default gpt-tiny); `startup_error` is shown at the top of the
    page (a `--model` that failed to load). With `warm`, the first model is analysed in a
    thread right away, so the page is usable sooner.
    """
    studio = Studio(extra_models)
    model = initial_model if initial_model in studio.builders else DEFAULT_MODEL
    manager = ThreadedDiskcacheManager(diskcache.Cache(tempfile.mkdtemp(prefix="remat-app-")))
    app = dash.Dash(
        __name__,
        title="Remat Studio",
        assets_folder=str(ASSETS),
        background_callback_manager=manager,
        update_title=None,
    )
    method = studio.default_method()
    app.layout = build_layout(
        list(studio.builders), model, method, [method], startup_error=startup_error
    )
    callbacks.register(app, studio)
    app.studio = studio  # for tests and the benchmark
    if warm:
        key = studio.key(model, "estimated", "cpu")
        threading.Thread(target=_quietly, args=(studio.problem, key), daemon=True).start()
    return app


def serve(
    host: str = "127.0.0.1", port: int = 8050, model: str | None = None, debug: bool = False
) -> None:
    """Serve the app on http://host:port/, opened on gpt-tiny or on `model`
    ("package.module:callable" returning (model, example_inputs))."""
    extra, error, initial = {}, "", None
    if model:
        try:
            extra[model], initial = resolve_builder(model), model
        except ModelSpecError as e:
            error = f"{e}. Showing the sample models instead."
    app = create_app(extra, initial_model=initial, startup_error=error)
    print(f"Remat Studio: http://{host}:{port}/", flush=True)
    if error:
        print(error, flush=True)
    app.run(host=host, port=port, debug=debug)


def _quietly(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except Exception:  # the page shows the error when it asks for the same model
        pass
