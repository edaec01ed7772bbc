"""The lesson's answers read the cached plans, not the controls' momentary values."""

from __future__ import annotations

from types import SimpleNamespace

from app.lesson import STEPS
from app.readback import slider_minimum


class _Studio:
    """The two reads the floor step's answer makes: the problem and a method's minimum."""

    offload_method = "offload"
    minimums = {"offload": 305_000, "rockmate": 560_000}

    def problem(self, key: str) -> SimpleNamespace:
        floor = SimpleNamespace(op="_log_softmax_backward_data", label="x", nbytes=190_000)
        return SimpleNamespace(floor=floor, store_all_peak=1_000_000)

    def minimum(self, key: str, method: str) -> int:
        return self.minimums[method]


def test_the_floor_answer_names_the_lowest_budget_whatever_the_slider_shows() -> None:
    # the reveal can arrive before the slider is clamped to offloading's minimum (a CI run
    # answered "56%", recomputation's minimum, while the slider settled at 30.5%)
    studio = _Studio()
    low = slider_minimum(studio.minimums["offload"], 1_000_000)
    for shown in (low, 56.0, 100.0):
        said = STEPS[-1].answer(studio, "gpt-tiny", shown)  # type: ignore[arg-type]
        assert f"The lowest budget here, {low:g}%, is {low - 19.0:.1f} points above" in said
