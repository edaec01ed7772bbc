"""A model switch's analysis goes before the background charts' traces: memory against batch
traces the model on screen five times (a minute on gpt2-small here), and a new model's
analysis used to queue behind all of them."""

from __future__ import annotations

import threading

from app import state


def test_an_analysis_waiting_goes_before_the_next_background_trace():
    order: list[str] = []
    holding, release = threading.Event(), threading.Event()

    def background() -> None:
        for i in range(2):
            with state.after_the_page():
                order.append(f"trace {i}")
                if i == 0:
                    holding.set()
                    assert release.wait(60)

    def analysis() -> None:
        with state.first_in_line():
            order.append("analysis")

    bg = threading.Thread(target=background)
    bg.start()
    assert holding.wait(60)
    fg = threading.Thread(target=analysis)
    fg.start()
    with state._WAITING:  # the analysis is in line for the lock
        assert state._WAITING.wait_for(lambda: state.analyses_waiting() > 0, timeout=60)
    release.set()
    fg.join(60)
    bg.join(60)
    assert order == ["trace 0", "analysis", "trace 1"]
