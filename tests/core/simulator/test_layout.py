"""Arena layout (core.layout): no two live storages share a byte; the arena holds the live peak."""

import pytest
from helpers import recompute_plan, step_graphs
from hypothesis import given, settings
from hypothesis import strategies as st

import core
from core.layout import arena, assign_offsets
from core.reorder import reorder
from core.schedule import store_all_plan


def assert_disjoint(placements) -> None:
    for i, a in enumerate(placements):
        for b in placements[i + 1 :]:
            if a.first <= b.last and b.first <= a.last:  # live at a common step
                assert a.offset + a.size <= b.offset or b.offset + b.size <= a.offset, (a, b)


def live_at_each_step(placements, n_steps: int) -> list[int]:
    live = [0] * n_steps
    for p in placements:
        for s in range(p.first, p.last + 1):
            live[s] += p.size
    return live


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 50), st.integers(0, 12), st.integers(0, 6)),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from([1, 8]),
)
def test_offsets_never_overlap_live_storages(items, alignment):
    lives = [(i, size, first, first + span) for i, (size, first, span) in enumerate(items)]
    placements = assign_offsets(lives, alignment)
    assert_disjoint(placements)
    assert all(
        p.offset % alignment == 0 and p.size >= s for p, (_, s, _, _) in zip(placements, lives)
    )
    top = max(p.offset + p.size for p in placements)
    assert top >= max(live_at_each_step(placements, 19))


@settings(max_examples=100, deadline=None)
@given(step_graphs(), st.lists(st.booleans(), min_size=12, max_size=12))
def test_plan_arenas_hold_exactly_the_simulated_live_bytes(problem, keep_bits):
    for plan in (store_all_plan(problem), reorder(recompute_plan(problem, keep_bits))):
        layout = arena(plan)
        timeline = plan.timeline
        assert_disjoint(layout.placements)
        # the lifetimes are the simulator's: live bytes agree at every step
        assert live_at_each_step(layout.placements, len(timeline)) == [s.live for s in timeline]
        assert layout.size >= layout.live_peak == plan.predicted_peak
        assert layout.fragmentation >= 1.0


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_sample_model_arenas(name, analysed):
    _, _, problem = analysed(name)
    for plan in (store_all_plan(problem), core.solve(problem, 1.0, method="checkpoint_blocks")):
        layout = arena(plan, alignment=512)
        assert_disjoint(layout.placements)
        assert all(p.offset % 512 == 0 for p in layout.placements)
        assert layout.size >= layout.live_peak == plan.predicted_peak
