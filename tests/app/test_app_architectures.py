"""Models from the page: the Hugging Face architectures at their published sizes
(`sample_models.hf_archs`, the menu `app.architectures`), `remat app --model` given several
times, and nothing typed in the page importing code."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import serve_in_thread

from app import ids
from app.architectures import ShapeError, add, model_options
from app.cli import main
from app.state import Studio
from sample_models.hf_archs import ARCHITECTURES, Architecture, build, parse_menu_name

# a module whose import leaves a mark: nothing typed in the page may import it
TRAP = "import pathlib\npathlib.Path(__file__).with_suffix('.imported').touch()\n"
TRAP += "def build():\n    raise SystemExit('built')\n"


@pytest.fixture
def trap(tmp_path, monkeypatch):
    (tmp_path / "trapmod.py").write_text(TRAP)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "trapmod.imported"
    assert "trapmod" not in sys.modules


def test_each_architecture_is_built_on_meta_at_its_published_size():
    """The configs written here give the published parameter counts (GPT-2 124M, Llama 3 8B
    8.03 B, ...), in the checkpoint's dtype, on the meta device, and a step with its loss."""
    for name, arch in ARCHITECTURES.items():
        call = build(name, 2, 16)
        params = list(call.model.parameters())
        assert sum(p.numel() for p in params) == arch.params, name
        assert {p.device.type for p in params} == {"meta"} and params[0].dtype == arch.dtype
        assert call.args[0].shape == (2, 16) and call.kwargs["labels"] is call.args[0]
    assert round(ARCHITECTURES["llama3-8b"].params / 1e9, 2) == 8.03
    assert round(ARCHITECTURES["gpt2-small"].params / 1e6) == 124


def test_a_typed_name_not_in_the_menu_is_refused_without_importing(trap):
    studio = Studio()
    before = dict(studio.builders)
    for name in ("trapmod:build", "trapmod", "trapmod build", "os:system"):
        with pytest.raises(ShapeError, match="unknown architecture"):
            add(studio, name, 1, 64)
    for batch, seq in ((0, 64), (1, 10**6), ("1", 64), (1.5, 64), (None, 64)):
        with pytest.raises(ShapeError, match="whole number"):
            add(studio, "llama3-8b", batch, seq)
    assert studio.builders == before  # nothing added
    for model in ("trapmod:build", "trapmod build", "llama3-8b 1x999999"):  # the model menu
        with pytest.raises(KeyError):
            studio.problem(studio.key(model, "estimated", "h100"))
    assert not trap.exists()
    value = add(studio, "llama3-8b", 1, 8192)  # a name of the table: added, not yet built
    assert value == "llama3-8b 1x8192" and parse_menu_name(value) == ("llama3-8b", 1, 8192)
    assert value in model_options(studio)


def test_the_menus_request_naming_a_module_is_answered_in_words_without_importing(trap):
    """What the page sends when "plan it" is pressed, with a module's name typed in place of
    an architecture (the request forged past the menu): refused in words, nothing imported."""
    from app.server import create_app

    app = create_app(warm=False)
    key = next(k for k in app.callback_map if f"{ids.ARCH_ERROR}.children" in k)
    outputs = [o.split("@")[0].rsplit(".", 1) for o in key.strip(".").split("...")]
    state = {
        ids.ARCH: "trapmod:build",
        ids.ARCH_BATCH: 1,
        ids.ARCH_SEQ: 64,
        ids.ARCH_DEVICE: "h100",
    }
    body = {
        "output": key,
        "outputs": [{"id": i, "property": p} for i, p in outputs],
        "inputs": [{"id": ids.ARCH_PLAN, "property": "n_clicks", "value": 1}],
        "state": [{"id": i, "property": "value", "value": v} for i, v in state.items()],
        "changedPropIds": [f"{ids.ARCH_PLAN}.n_clicks"],
    }
    answer = app.server.test_client().post("/_dash-update-component", json=body).get_json()
    said = answer["response"][ids.ARCH_ERROR]
    assert said["hidden"] is False and "unknown architecture 'trapmod:build'" in said["children"]
    assert ids.MODEL not in answer["response"] and not trap.exists()


def test_app_menu_lists_each_of_several_models(monkeypatch, tmp_path):
    """`remat app --model a --model b`: both are in the page's model menu, the first open."""
    (tmp_path / "twomenu.py").write_text(
        "import torch\n"
        "def small():\n    return torch.nn.Linear(4, 4), (torch.randn(2, 4),)\n"
        "def big():\n    return torch.nn.Linear(8, 8), (torch.randn(2, 8),)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import dash

    served = []
    monkeypatch.setattr(dash.Dash, "run", lambda self, **kw: served.append(self))
    from app import server

    real = server.create_app
    monkeypatch.setattr(server, "create_app", lambda *a, **kw: real(*a, **kw, warm=False))
    assert main(["app", "--port", "0", "--model", "twomenu:small", "--model", "twomenu:big"]) == 0
    menu = find(served[0].layout, ids.MODEL)
    assert menu.value == "twomenu:small"
    assert menu.options[-2:] == ["twomenu:small", "twomenu:big"]


def test_will_it_fit_says_each_total_against_the_device_and_the_kernel_assumed():
    from app.callbacks.fit import fit_words
    from core.footprint import Footprint

    gib = 1 << 30
    plain = Footprint(15 * gib, 30 * gib, 0, 60 * gib, gib, 0, 80 * gib, "h100")
    ours = Footprint(15 * gib, 30 * gib, 0, 20 * gib, gib, 0, 80 * gib, "h100")
    said = fit_words([("plain", plain), ("ours", ours)], "Rockmate at 40%", "h100", "attention: x")
    assert said == (
        "On an H100 (80.0 GiB): plain PyTorch needs 106.0 GiB: does not fit, 26.0 GiB over; "
        "Rockmate at 40% needs 66.0 GiB: fits, 14.0 GiB to spare. Planned with attention: x."
    )
    assert fit_words([("p", ours), ("o", ours)], "x", "cpu", "").startswith("On this machine (")


def test_the_batch_chart_keeps_the_analysis_on_screen_as_one_of_its_batch_sizes():
    """Memory against batch traces each batch size; the one the page analysed (gpt-tiny's 4,
    op times estimated, no step switch) is that analysis, not a second trace."""
    from app.callbacks.batch import batch_probe

    studio = Studio()
    key = studio.key("gpt-tiny", "estimated", "h100")
    probe = batch_probe(studio, key)
    assert probe.problems == {4: studio.problem(key)}
    assert batch_probe(studio, studio.key("gpt-tiny", "measured", "cpu")).problems == {}


def test_the_batch_chart_traces_no_batch_whose_smaller_floor_is_over_the_device():
    """Once a batch size's floor and fixed bytes are over the device's memory, the larger
    batch sizes are said to be left out, not traced (an 8B model at 8,192 tokens: minutes)."""
    from app.batch import batch_rows
    from app.callbacks.batch import left_out
    from core import BatchProblems

    probe = BatchProblems(Studio().builders["mlp-tiny"](), None, "h100")
    one = probe.problem(1)
    small = one.param_bytes + one.floor.nbytes  # under batch 1's floor and fixed bytes
    rows, refused = batch_rows(probe, "rockmate", 0.6, (1, 2, 4), capacity=small)
    assert [r.batch for r in rows] == [1] and list(probe.problems) == [1]
    assert [b for b, _ in refused] == [2, 4] and "not traced: at batch 1" in refused[0][1]
    assert left_out(refused) == [f" Batches 2, 4 left out: {refused[0][1]}."]


def find(component, id_: str):
    """The component of a Dash layout with id `id_`."""
    if getattr(component, "id", None) == id_:
        return component
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children]:
        if hasattr(child, "to_plotly_json") and (got := find(child, id_)) is not None:
            return got
    return None


TINY = Architecture(
    "llama-tiny",
    "Llama (tiny: 2 layers, d64)",
    "the test's own",
    "llama",
    {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    },
    torch.bfloat16,
    256,
    106_816,
)


@pytest.mark.browser
def test_an_architecture_from_the_menu_is_planned_for_the_gpu_chosen(page, monkeypatch):
    """Pick an architecture, a shape and an H100 in the menu, press plan: the model menu
    holds it, and "Will it fit?" answers for an H100 naming the attention kernel assumed.
    (A tiny Llama put in the table: the menu is the same for the published sizes, which take
    a minute to analyse here; test_each_architecture_... builds those.)"""
    from app.server import create_app
    from bench.app import choose, wait_calm, wait_ready

    monkeypatch.setitem(ARCHITECTURES, TINY.name, TINY)
    address, stop = serve_in_thread(create_app(initial_model="mlp-tiny", warm=False))
    try:
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.goto(address)
        wait_ready(page, "mlp-tiny")
        choose(page, ids.ARCH, TINY.name)
        page.wait_for_function(
            "(id) => document.getElementById(id).textContent.includes('the test')",
            arg=ids.ARCH_NOTE,
        )
        page.fill(f"#{ids.ARCH_SEQ}", "64")
        page.click(f"#{ids.ARCH_PLAN}")
        wait_ready(page, "llama-tiny 1x64")
        page.wait_for_function(
            "(id) => document.getElementById(id).textContent.startsWith('On an H100')",
            arg=ids.FIT_TEXT,
        )
        said = page.inner_text(f"#{ids.FIT_TEXT}")
        assert "plain PyTorch needs" in said and ": fits," in said
        assert "Planned with attention: flash attention (assumed for h100, bfloat16" in said
        assert page.inner_text(f"#{ids.ARCH_FIT}") == said  # beside the menu too
        wait_calm(page)  # the page's watcher reads the model menu's name as the views'
        assert "llama-tiny 1x64" in page.inner_text(f"#{ids.MODEL}")
    finally:
        stop()
