"""Tampered plans: every edit of a valid plan file gets a named error or runs exactly.

Exactly means the gradients equal eager PyTorch's and the measured peak equals the recomputed
prediction (+4 bytes: the scalar seed of `loss.backward()`). Never another exception type.
"""

from __future__ import annotations

import pickle
import struct
import time

import pytest
import torch
from helpers import assert_same_grads, fresh, measured_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import core
from core.errors import PlanFileError, PlanMismatch, RematError
from core.plan import Plan, SavedPlan
from core.plan_io import MAX_FILE_BYTES, from_bytes
from core.schedule import plan_from_runs
from core.simulator import FREE, RUN


def plan_from_bytes(raw: bytes, name: str = "plan") -> Plan:
    """What load_plan does with a file's bytes."""
    return SavedPlan.from_data(from_bytes(raw, name), name)


def plan_to_data(plan: Plan) -> dict:
    return plan.to_data()


SEED_BYTES = 4  # the scalar gradient loss.backward() allocates
OUTCOMES: list[tuple[str, str]] = []  # (variant, outcome): printed at the end of the module


class TwoDropouts(nn.Module):
    """Two independent branches, each with its own dropout: their order sets the random stream."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.drop(self.a(x)) * self.drop(self.b(x))).sum()


@pytest.fixture(scope="module")
def gpt():
    """gpt-tiny, its problem (bound to the model), a valid plan with recomputes, eager's step."""
    torch.manual_seed(0)
    model, inputs = fresh("gpt-tiny")
    problem = core.analyze(model, inputs)
    plan = core.solve(problem, 0.6, method="checkpoint_blocks")
    _, _, want = measured_step(model, inputs)
    return model, inputs, problem, plan, want


def _outcome(name: str, model, inputs, want, load, bind=None) -> str:
    """Load and apply a variant: the named error it gets, or "ran exactly" (checked)."""
    try:
        plan = load()
        if bind is not None:
            plan = plan.on(bind)
        wrapped = core.apply_plan(model, plan)
        plan = wrapped.plan  # bound to the model's trace: its figures recomputed
    except RematError as e:
        OUTCOMES.append((name, f"{type(e).__name__}: {str(e)[:110]}"))
        return type(e).__name__
    peak, _, got = measured_step(model, inputs, run=wrapped)
    assert_same_grads(got, want)
    assert peak == plan.predicted_peak + SEED_BYTES, (name, peak, plan.predicted_peak)
    assert plan.predicted_peak <= plan.budget
    OUTCOMES.append((name, f"ran exactly (peak {peak} B = recomputed prediction + 4)"))
    return "ran"


def _file(data: dict, protocol: int = 4) -> bytes:
    return pickle.dumps(data, protocol=protocol)


def _program_variants(plan: Plan, problem) -> dict[str, tuple[list, int]]:
    """The issue's edits of a program: name -> (program, backward_start)."""
    prog, start = [list(i) for i in plan.program], plan.backward_start
    runs = [i for i, (k, _) in enumerate(prog) if k == RUN]
    frees = [i for i, (k, _) in enumerate(prog) if k == FREE]
    graph = problem.graph
    first_free = prog[frees[0]]
    final = sorted(graph.final_values)[0]
    bwd_runs = [i for i in runs if i >= start]
    v = {}
    v["run index out of range"] = ([*prog[:5], [RUN, len(graph.ops) + 7], *prog[5:]], start + 1)
    v["free index out of range"] = ([*prog, [FREE, len(graph.values)]], start)
    v["value freed twice"] = (prog[: frees[0] + 1] + [first_free] + prog[frees[0] + 1 :], start + 1)
    v["value freed before it exists"] = ([first_free, *prog], start + 1)
    v["free before its run"] = ([prog[0], first_free, *prog[1:]], start + 1)
    v["step output freed"] = ([*prog, [FREE, final]], start)
    v["backward op dropped"] = (prog[: bwd_runs[-1]] + prog[bwd_runs[-1] + 1 :], start)
    k = next(k for k in range(len(runs) - 1) if _reads(graph, prog[runs[k]], prog[runs[k + 1]]))
    swapped = [list(i) for i in prog]
    swapped[runs[k]], swapped[runs[k + 1]] = prog[runs[k + 1]], prog[runs[k]]
    v["forward op swapped with its consumer"] = (swapped, start)
    v["backward op in the forward (start moved late)"] = (prog, bwd_runs[1])
    v["recompute of a live value"] = ([prog[0], prog[0], *prog[1:]], start + 1)
    no_frees = [i for i in prog if i[0] == RUN]
    v["every FREE removed"] = (no_frees, sum(1 for i in prog[:start] if i[0] == RUN))
    v["backward_start at the end"] = (prog, len(prog))
    v["backward_start misplaced early"] = (prog, 1)
    return v


def _reads(graph, first: list, second: list) -> bool:
    """Whether the op of run `second` reads a value the op of run `first` produces."""
    return bool(set(graph.ops[first[1]].outputs) & set(graph.ops[second[1]].inputs))


@pytest.mark.slow
def test_tampered_programs_in_files(gpt):
    model, inputs, problem, plan, want = gpt
    data = plan_to_data(plan)
    got = {}
    variants = _program_variants(plan, problem)
    for name, (program, start) in variants.items():
        d = dict(data, program=[list(i) for i in program], backward_start=start)
        got[name] = _outcome(name, model, inputs, want, lambda d=d: plan_from_bytes(_file(d)))
    for name, edit in {
        "negative run index": {"program": [[RUN, -1], *data["program"][1:]]},
        "backward_start 0": {"backward_start": 0},
        "backward_start negative": {"backward_start": -3},
        "empty program": {"program": [], "backward_start": 0},
        "version 0": {"version": 0},
        "version -7": {"version": -7},
        "version True": {"version": True},
        "version 1.0": {"version": 1.0},
        "instruction kind 'exec'": {"program": [["exec", 0], *data["program"][1:]]},
    }.items():
        d = dict(data, **edit)
        got[name] = _outcome(name, model, inputs, want, lambda d=d: plan_from_bytes(_file(d)))
    # none of these edits leaves a valid program: each is refused with a named error
    assert set(got.values()) == {"InvalidPlan", "PlanFileError"}, got
    # a plan without recomputes and without its FREEs: valid for the simulator, but its peak
    # exceeds its budget
    store_all = core.solve(problem, 1.0, method="store_all")
    kept = [[k, t] for k, t in store_all.program if k == RUN]
    start = sum(1 for k, _ in store_all.program[: store_all.backward_start] if k == RUN)
    d = dict(plan_to_data(store_all), program=kept, backward_start=start)
    name = "every FREE removed (store_all plan)"
    load = lambda: plan_from_bytes(_file(d))  # noqa: E731
    assert _outcome(name, model, inputs, want, load) == "InvalidPlan"
    assert "above the plan's budget" in OUTCOMES[-1][1]
    assert {got[n] for n in got if n not in variants} == {"PlanFileError"}


def test_an_edited_recorded_prediction_is_refused_not_run(gpt):
    """The figures a plan file records are what the user was shown: bound under the plan's
    own costs they must come out the same, so an edited figure is a PlanMismatch naming
    both, never a plan run under figures it does not have."""
    model, inputs, _, plan, want = gpt
    d = dict(plan_to_data(plan), predicted=[1, 1e-9, 0.5])
    loaded = plan_from_bytes(_file(d))
    assert _outcome("predicted peak set to 1 byte", model, inputs, want, lambda: loaded) == (
        "PlanMismatch"
    )
    with pytest.raises(PlanMismatch, match=r"records a peak of 1 B .* walks to"):
        core.apply_plan(model, loaded)


def test_swapped_dropouts_are_refused():
    torch.manual_seed(0)
    model, x = TwoDropouts(), torch.randn(8, 16)
    problem = core.analyze(model, (x,))
    plan = core.solve(problem, 1.0, method="store_all")
    _, _, want = measured_step(model, (x,))
    graph = problem.graph
    drops = [o.index for o in graph.ops if o.random]
    assert len(drops) == 2
    # the second dropout's branch first, then the rest in traced order: a valid dependency
    # order in which the two random ops draw from the random stream in swapped order
    needed, stack = set(), [drops[1]]
    while stack:
        o = stack.pop()
        if o is not None and o not in needed:
            needed.add(o)
            stack += [graph.values[v].producer for v in graph.ops[o].inputs]
    first = [o for o in graph.forward_ops if o in needed]
    runs = first + [o for o in graph.forward_ops if o not in needed] + graph.backward_ops
    swapped = plan_from_runs(problem, runs, len(graph.forward_ops), "store_all", plan.budget)
    program = [list(i) for i in swapped.program]
    d = dict(plan_to_data(plan), program=program, backward_start=swapped.backward_start)
    name = "two independent dropouts swapped"
    got = _outcome(name, model, (x,), want, lambda: plan_from_bytes(_file(d)))
    assert got == "InvalidPlan"
    assert "out of traced order" in OUTCOMES[-1][1]
    # the untouched plan runs exactly: the check refuses the swap, not the model
    assert _outcome("two dropouts, untouched", model, (x,), want, lambda: plan) == "ran"


def _two(shape: list, dtype: object, grad: object, n: int = 2) -> list:
    """n input entries, each its own list (a file never shares a container)."""
    return [[list(shape), dtype, grad] for _ in range(n)]


@pytest.mark.slow
def test_edited_graph_metadata(gpt):
    model, inputs, _, plan, want = gpt
    data = plan_to_data(plan)
    meta = data["graph_meta"]
    shape, dtype, grad = meta["inputs"][0]
    edits = {
        "input shape inflated to 2**15 x 2**15": {"inputs": _two([2**15, 2**15], dtype, grad)},
        "input shape [1, 1]": {"inputs": _two([1, 1], dtype, grad)},
        "input dtype 'manual_seed'": {"inputs": _two(shape, "manual_seed", grad)},
        "input dtype float32": {"inputs": _two(shape, "float32", grad)},
        "input requires_grad 'yes'": {"inputs": _two(shape, dtype, "yes")},
        "parameter specs of the wrong type": {"params": [[n, 3] for n, _ in meta["params"]]},
        "parameters an int": {"params": 7},
        "huge input list": {"inputs": _two(shape, dtype, grad, 100_000)},
        "negative dimension": {"inputs": _two([-4, 64], dtype, grad)},
        "call tree not JSON": {"call": dict(meta["call"], tree="{not json")},
        "call tree of another type": {
            "call": dict(meta["call"], tree=meta["call"]["tree"].replace("builtins.tuple", "os"))
        },
        "call with an extra constant": {"call": dict(meta["call"], constants=[[0, "x"]])},
        "call constant an object": {"call": dict(meta["call"], constants=[[0, {"a": 1}]])},
        "call targets beyond the inputs": {"call": dict(meta["call"], targets=5)},
        "call missing": {"call": "positional"},
    }
    for name, edit in edits.items():
        d = dict(data, graph_meta=dict(meta, **edit))
        start = time.perf_counter()
        got = _outcome(name, model, inputs, want, lambda d=d: plan_from_bytes(_file(d)))
        seconds = time.perf_counter() - start
        assert got in ("PlanFileError", "PlanMismatch"), name
        assert seconds < 5, (name, seconds)  # a trace at most; nothing allocated


def _spliced(data: dict, field: str, payload: bytes) -> bytes:
    """A protocol-2 pickle of `data` whose `field` is replaced by raw opcodes `payload`."""
    marker = "@" * 7
    raw = _file(dict(data, **{field: marker}), protocol=2)
    text = marker.encode()
    needle = b"X" + struct.pack("<I", len(text)) + text  # BINUNICODE
    assert raw.count(needle) == 1
    return raw.replace(needle, payload)


def _laughs(depth: int, width: int) -> object:
    x: object = ["ha"] * width
    for _ in range(depth):
        x = [x] * width
    return x


def test_hostile_files_are_refused_fast(gpt):
    _, _, _, plan, _ = gpt
    data = plan_to_data(plan)
    deep = b"]" * 1_000_000 + b"a" * 999_999  # EMPTY_LIST x 1e6, APPEND x (1e6 - 1)
    files = {
        "billion laughs in notes": _file(dict(data, notes=[_laughs(9, 10)])),
        "billion laughs in method": _file(dict(data, method=_laughs(9, 10))),
        "billion laughs in fingerprint": _file(dict(data, fingerprint=_laughs(9, 10))),
        "memo index 2**30": _spliced(data, "method", b"}r" + struct.pack("<I", 2**30)),
        "memo get 0xffffffff": _spliced(data, "notes", b"j" + struct.pack("<I", 0xFFFFFFFF)),
        "1e6-deep list in method": _spliced(data, "method", deep),
        "1e6-deep list in notes": _spliced(data, "notes", deep),
        "1e6-deep list in graph_meta": _spliced(data, "graph_meta", deep),
        "BUILD on a dict": _spliced(data, "notes", b"}}b"),
        "BUILD on a list": _spliced(data, "notes", b"]}b"),
        "BINUNICODE8 of length 2**63": _spliced(data, "method", b"\x8d" + struct.pack("<Q", 2**63)),
        "extension code (EXT1)": _spliced(data, "method", b"\x82\x01"),
        "GLOBAL os.system": _spliced(data, "method", b"cos\nsystem\n"),
        "a torch module": pickle.dumps(nn.Linear(2, 2)),
        "file over the size cap": _file(data) + bytes(MAX_FILE_BYTES),
        "random bytes": bytes(range(256)) * 64,
        "truncated": _file(data)[:200],
    }
    times = {}
    for name, raw in files.items():
        start = time.perf_counter()
        with pytest.raises(PlanFileError) as err:
            plan_from_bytes(raw, name)
        times[name] = time.perf_counter() - start
        OUTCOMES.append(
            (name, f"PlanFileError in {times[name] * 1e3:.0f} ms: {str(err.value)[:90]}")
        )
    print("\nhostile files, seconds to refuse:")
    for name, s in times.items():
        print(f"  {s:.3f}  {name}")
    assert max(times.values()) < 1.0, times


_EDIT = st.one_of(
    st.tuples(st.just("delete"), st.integers(0, 10**6)),
    st.tuples(st.just("duplicate"), st.integers(0, 10**6)),
    st.tuples(st.just("swap"), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("retarget"), st.integers(0, 10**6), st.integers(-3, 2000)),
    st.tuples(st.just("flip"), st.integers(0, 10**6)),
    st.tuples(st.just("move start"), st.integers(-3, 3)),
)


def _mutate(plan: Plan, edits: list) -> tuple[list, int]:
    prog, start = [list(i) for i in plan.program], plan.backward_start
    for e in edits:
        n = len(prog)
        if e[0] == "move start":
            start += e[1]
        elif n == 0:
            continue
        elif e[0] == "delete":
            del prog[e[1] % n]
            start -= e[1] % n < start
        elif e[0] == "duplicate":
            prog.insert(e[1] % n, list(prog[e[1] % n]))
            start += e[1] % n < start
        elif e[0] == "swap":
            i, j = e[1] % n, e[2] % n
            prog[i], prog[j] = prog[j], prog[i]
        elif e[0] == "retarget":
            prog[e[1] % n][1] = e[2]
        else:
            prog[e[1] % n][0] = FREE if prog[e[1] % n][0] == RUN else RUN
    return prog, start


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(edits=st.lists(_EDIT, min_size=1, max_size=3))
def test_random_program_mutations(gpt, edits):
    model, inputs, problem, plan, want = gpt
    program, start = _mutate(plan, edits)
    d = dict(plan_to_data(plan), program=program, backward_start=start)
    name = f"random program edits {edits}"
    _outcome(name, model, inputs, want, lambda: plan_from_bytes(_file(d)), bind=problem)


_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.lists(st.integers(-5, 5), max_size=4),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


FIELDS = ["version", "method", "budget", "fingerprint", "graph_meta", "backward_start",
          "program", "predicted", "notes", "format"]  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), junk=_JUNK, drop=st.booleans())
def test_random_field_edits(gpt, field, junk, drop):
    model, inputs, problem, plan, want = gpt
    d = plan_to_data(plan)
    d = {k: v for k, v in d.items() if k != field} if drop else dict(d, **{field: junk})
    name = f"field {field} " + ("dropped" if drop else f"= {junk!r}"[:50])
    _outcome(name, model, inputs, want, lambda: plan_from_bytes(_file(d)), bind=problem)


@pytest.fixture(scope="module", autouse=True)
def _print_outcomes():
    """The table of variants and what each got, after the module (run with -s to see it)."""
    yield
    named = [o for o in OUTCOMES if not o[0].startswith(("random", "field"))]
    print(f"\n{len(OUTCOMES)} variants, {len(named)} named:")
    for name, outcome in named:
        print(f"  {name:42} -> {outcome}")
