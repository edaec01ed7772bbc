"""The command line answers at once when no analysis is needed: `remat --help` and argument
errors import neither torch nor dash (7 s here before), budgets and memories are read before
any analysis, and `remat fit` says where its search stopped and whose op times it used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.cli import main

# Runs `remat ARGS` in a fresh interpreter: its exit code, its stderr, and whether torch or
# dash were imported by the time it returned.
PROBE = """
import contextlib, io, json, sys
from app.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    code = main(sys.argv[1:])
print(json.dumps({"code": code, "err": err.getvalue(),
    "heavy": sorted(m for m in ("torch", "dash", "core") if m in sys.modules)}))
"""


def remat(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(
    "args, code, said",
    [
        (["--help"], 0, ""),
        (["plan", "--help"], 0, ""),
        (["plan", "gpt-tiny", "--budget", "abc"], 2, "cannot read the budget 'abc'"),
        (["plan", "gpt-tiny", "--budget", "0%"], 2, "a percentage of the store-all peak"),
        (["fit", "gpt-tiny", "--memory", "lots"], 2, "e.g. 24GiB, 80GB or 512MiB, not 'lots'"),
        (["parallel", "gpt-tiny", "--devices", "2", "--memory", "80"], 2, "with a unit"),
        (["app", "--port", "99999"], 2, "is not a TCP port"),
    ],
)
def test_help_and_argument_errors_import_neither_torch_nor_dash(args, code, said):
    got = remat(*args)
    assert got["code"] == code and said in got["err"], got
    assert got["heavy"] == [], f"`remat {' '.join(args)}` imported {got['heavy']}"


@pytest.mark.slow  # traces mlp-tiny at a few batch sizes
def test_fit_says_where_the_search_stopped_and_whose_op_times_it_used(capsys):
    assert main(["fit", "mlp-tiny", "--memory", "24GiB", "--max-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "op times estimated for h100, the default: --device" in out
    assert "8+" in out and "the search stopped at --max-batch 8" in out
    assert (
        main(["fit", "mlp-tiny", "--memory", "24GiB", "--max-batch", "8", "--device", "a100"]) == 0
    )
    out = capsys.readouterr().out
    assert "op times estimated for a100;" in out and "the default" not in out


def test_app_takes_several_models_and_resolves_each_at_start_up(monkeypatch, tmp_path):
    (tmp_path / "twomods.py").write_text(
        "import torch\n"
        "def small():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n"
        "def big():\n    return torch.nn.Linear(8, 8), (torch.randn(2, 8),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import app.server

    asked = {}
    monkeypatch.setattr(app.server, "serve", lambda **kw: asked.update(kw))
    assert main(["app", "--model", "twomods:small", "--model", "twomods:big"]) == 0
    assert asked["models"] == ["twomods:small", "twomods:big"]
    extra = app.server.extra_models(asked["models"])
    assert list(extra) == ["twomods:small", "twomods:big"]  # in the menu, in order
    assert extra["twomods:big"]().model.in_features == 8
