"""Plan files: plain data, a loader that never runs code, clear errors for bad files."""

import json
import pickle
import subprocess
import sys

import pytest
import torch
from helpers import SEED_BYTES, assert_same_grads, fresh, measured_step

import core
import core.simulator
from core.errors import PlanFileError
from core.plan_io import VERSION
from core.schedule import store_all_plan


@pytest.fixture(scope="module")
def gpt_tiny_plan(analysed):
    return core.solve(analysed("gpt-tiny")[2], 0.6, method="checkpoint_blocks")


def test_round_trip_applies_and_matches(tmp_path, gpt_tiny_plan):
    path = tmp_path / "plan.pkl"
    gpt_tiny_plan.save(path)
    loaded = core.load_plan(path)
    assert loaded.program == gpt_tiny_plan.program
    assert loaded.predicted_peak == gpt_tiny_plan.predicted_peak
    model, inputs = fresh("gpt-tiny")
    _, _, want = measured_step(model, inputs)
    peak, _, got = measured_step(model, inputs, run=core.apply_plan(model, loaded))
    assert_same_grads(got, want)
    assert peak == gpt_tiny_plan.predicted_peak + SEED_BYTES


def test_a_plan_built_by_hand_has_no_budget_and_still_round_trips(tmp_path, gpt_tiny_plan):
    """Plans made outside `core.solve` (store_all_plan, a program of one's own) carry budget
    0, which the validator reads as none: the file they save loads again."""
    problem = gpt_tiny_plan.problem
    plan = store_all_plan(problem)
    assert plan.budget == 0
    plan.save(tmp_path / "plan.pkl")
    loaded = core.load_plan(tmp_path / "plan.pkl")
    assert loaded.budget == 0 and loaded.program == plan.program


def test_file_holds_plain_data_only(tmp_path, gpt_tiny_plan):
    path = tmp_path / "plan.pkl"
    gpt_tiny_plan.save(path)
    ops = {op.name for op, _, _ in __import__("pickletools").genops(path.read_bytes())}
    assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "INST", "OBJ", "NEWOBJ"}


def test_truncated(tmp_path, gpt_tiny_plan):
    path = tmp_path / "plan.pkl"
    gpt_tiny_plan.save(path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(PlanFileError, match="truncated"):
        core.load_plan(path)


def test_random_bytes(tmp_path):
    path = tmp_path / "plan.pkl"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(PlanFileError):
        core.load_plan(path)


def test_another_programs_pickle(tmp_path):
    path = tmp_path / "plan.pkl"
    path.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    with pytest.raises(PlanFileError, match="not a Remat Studio plan"):
        core.load_plan(path)
    path.write_bytes(pickle.dumps(torch.nn.Linear(2, 2)))
    with pytest.raises(PlanFileError, match="refusing"):
        core.load_plan(path)


def test_newer_version(tmp_path, gpt_tiny_plan):
    data = gpt_tiny_plan.to_data()
    data["version"] = VERSION + 1
    path = tmp_path / "plan.pkl"
    path.write_bytes(pickle.dumps(data))
    with pytest.raises(PlanFileError, match="newer"):
        core.load_plan(path)


class _Payload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def test_hostile_pickle_never_runs(tmp_path):
    victim = tmp_path / "pwned.txt"
    path = tmp_path / "plan.pkl"
    path.write_bytes(pickle.dumps({"format": "remat-studio-plan", "x": _Payload(str(victim))}))
    with pytest.raises(PlanFileError, match="refusing"):
        core.load_plan(path)
    assert not victim.exists()


def test_load_and_apply_never_solves(tmp_path, gpt_tiny_plan, monkeypatch):
    """Loading and applying a saved plan retraces the model and checks the program by one
    simulation (`core.validate`), but never solves (every solver fails here if called)."""
    path = tmp_path / "plan.pkl"
    gpt_tiny_plan.save(path)

    def forbidden(*args, **kwargs):
        raise AssertionError("apply_plan of a loaded plan must not plan again")

    for method in core.solvers.SOLVERS:
        monkeypatch.setitem(core.solvers.SOLVERS, method, forbidden)
    model, _ = fresh("gpt-tiny")
    planned = core.apply_plan(model, core.load_plan(path))
    assert planned.plan.program == gpt_tiny_plan.program


_FRESH = """
import json, sys
import core
from sample_models import build
model, inputs = build("gpt-tiny")
out = {}
for path in sys.argv[1:]:
    saved = core.load_plan(path)
    bound = core.apply_plan(model, saved).plan
    out[path] = [bound.predicted_peak, bound.predicted_time, saved.predicted_time]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_a_measured_cost_plan_means_the_same_in_a_fresh_process(tmp_path):
    """The issue's case: gpt-tiny under measured costs, rockmate, offload and pofo plans
    saved, then loaded and applied in a fresh process: the same peak and time to the last bit
    (the plan file carries its op times and link), where re-costing on load gave 5.1 ms for
    7.9."""
    model, inputs = fresh("gpt-tiny")
    problem = core.analyze(model, inputs, costs="measured")
    assert problem.cost_model == "measured:cpu"
    want = {}
    for method in ("rockmate", "offload", "pofo"):
        plan = core.solve(problem, 0.5, method=method)
        path = str(tmp_path / f"{method}.pkl")
        plan.save(path)
        want[path] = [plan.predicted_peak, plan.predicted_time, plan.predicted_time]
    done = subprocess.run(
        [sys.executable, "-c", _FRESH, *want], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == want


def test_a_plan_for_a_step_of_other_ops_says_what_differs() -> None:
    """A loaded plan whose model now runs other ops (here one more ReLU; on a GPU, another
    torch's autocast casts) is refused by the trace's difference, not by its recorded costs'
    length."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    problem = core.analyze(model, (x,))
    saved = core.SavedPlan.from_data(core.solve(problem, 1.0).to_data())
    model[1] = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU())  # same parameters
    with pytest.raises(core.PlanMismatch, match="traced operations differ from the plan's"):
        core.apply_plan(model, saved)


def test_a_mismatch_names_the_first_ops_that_differ() -> None:
    """The plan records its op sequence: a refusal names where the traces part ways, op and
    module (on the H200, the laptop plans of HF models were refused by an op count only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    problem = core.analyze(model, (torch.randn(4, 8),))
    data = core.solve(problem, 1.0).to_data()
    assert data["graph_meta"]["ops"][:2] == ["aten.t@0", "aten.addmm@0"]
    saved = core.SavedPlan.from_data(data)
    model[1] = torch.nn.GELU()
    with pytest.raises(core.PlanMismatch) as caught:
        core.apply_plan(model, saved)
    message = str(caught.value)
    assert (
        "from op 3 on, the plan's trace ran aten.relu (in 1), aten.detach (in 1) where " in message
    )
    assert "where this one runs aten.gelu (in 1): make a new plan" in message


def test_a_plan_records_its_torch_and_a_mismatch_names_another(monkeypatch) -> None:
    """Another torch can dispatch other ops (on the H200, torch 2.11's CUDA autocast cast
    around cross-entropy where 2.13's lists do not): the refusal says which torch made it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    data = core.solve(core.analyze(model, (torch.randn(4, 8),)), 1.0).to_data()
    assert data["graph_meta"]["torch"] == torch.__version__
    data["graph_meta"]["torch"] = "2.11.0+cu130"
    saved = core.SavedPlan.from_data(data)
    model[1] = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU())
    with pytest.raises(core.PlanMismatch, match=r"traced with torch 2\.11\.0\+cu130, this is"):
        core.apply_plan(model, saved)


def test_a_mismatch_names_another_version_of_the_models_library() -> None:
    """The plan records the packages the model comes from: on the H200 (transformers 5.17)
    a plan made here (5.24) met other mask code (`fast_all`'s `sum`, `eq` where 5.17 runs
    `all`), and the refusal now says which versions made and met it."""
    from transformers import GPT2Config, GPT2Model

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = GPT2Model(config)
    ids = torch.randint(0, 32, (2, 8))
    problem = core.analyze(model, (ids,), {"use_cache": False})
    data = core.solve(problem, 1.0).to_data()
    import transformers

    assert data["graph_meta"]["libraries"] == [f"transformers {transformers.__version__}"]
    data["graph_meta"]["libraries"] = ["transformers 5.17.0"]
    data["fingerprint"] = "0" * 32  # the other version's trace: other ops
    saved = core.SavedPlan.from_data(data)
    with pytest.raises(core.PlanMismatch) as caught:
        core.apply_plan(model, saved)
    assert (
        f"the plan was traced with transformers 5.17.0, this is transformers "
        f"{transformers.__version__}" in str(caught.value)
    )
