"""Build and serve the app: `remat app` calls `serve`."""

from __future__ import annotations

import importlib
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


def load_spec(spec: str) -> tuple[str, Callable]:
    """(name, builder) for "package.module:callable"; raises ValueError in plain words."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r}: write package.module:callable")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import-time error of the user's module
        raise ValueError(f"--model {spec!r}: cannot import {module_name!r}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"--model {spec!r}: {module_name} has no callable {attr!r}")

    def build():
        result = fn()
        if not isinstance(result, tuple) or len(result) != 2:
            raise ValueError(f"{spec} must return (model, example_inputs), got {type(result)}")
        return result[0], tuple(result[1])

    return spec, build


def serve(
    host: str = "127.0.0.1", port: int = 8050, model: str | None = None, debug: bool = False
) -> None:
    """Serve the app on http://host:port/, opened on gpt-tiny or on `model`
    ("package.module:callable" returning (model, example_inputs))."""
    extra, error, initial = {}, "", None
    if model:
        try:
            name, build = load_spec(model)
            extra[name], initial = build, name
        except ValueError as e:
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
