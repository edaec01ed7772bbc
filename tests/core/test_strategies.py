"""The strategies users already run, imported (`core.strategies`): each predicted by the native
simulation to the byte (measured = predicted + 4 B, the seed of `loss.backward()`) when run by
its own mechanism (transformers' `gradient_checkpointing_enable`, PyTorch's
`checkpoint_wrapper` with torchtitan's policy, torchtune's offload hooks, auto-SAC's per-op
policies), with gradients `torch.equal` to eager's."""

from __future__ import annotations

import pytest
import torch
from native_cases import case, step
from torch import nn

import core
from core import strategies

aten = torch.ops.aten
MODELS = ["gpt-tiny", "hf-gpt2"]


def _case(name: str):
    """(model, args, kwargs, loss_fn, targets), HF models at their defaults (SDPA attention,
    dropout)."""
    if name == "hf-gpt2-d128":
        from transformers import GPT2Config, GPT2LMHeadModel

        from sample_models.hf_zoo import token_loss
        from sample_models.zoo import made

        cfg = GPT2Config(
            vocab_size=128,
            n_positions=64,
            n_embd=128,
            n_layer=2,
            n_head=4,
            bos_token_id=127,
            eos_token_id=127,
        )
        model = made(lambda: GPT2LMHeadModel(cfg))
        g = torch.Generator().manual_seed(0)
        ids, labels = (torch.randint(0, 128, (2, 64), generator=g) for _ in range(2))
        return model, (ids,), {"use_cache": False}, token_loss, (labels,)
    if name == "diffusers-unet":
        from sample_models import diffusers_zoo

        c = diffusers_zoo.unet()
        return c.model, c.args, c.kwargs, c.loss_fn, c.targets
    return case(name)


def _check(name: str, make) -> strategies.Imported:  # noqa: ANN001
    """Eager's gradients, then the strategy's step by its own mechanism: peak = predicted
    + 4 B, loss and gradients torch.equal to eager's."""
    model, args, kwargs, loss_fn, targets = _case(name)
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    _, loss0, grads0 = step(model, model, args, kwargs, loss_fn, targets)
    imported = make(problem, model, args, kwargs, targets)
    run = imported.step(model)
    peak, loss, grads = step(model, run, args, kwargs, loss_fn, targets)
    assert peak == imported.prediction.peak + 4, (name, imported.key)
    assert torch.equal(loss, loss0)
    assert grads.keys() == grads0.keys()
    # on a failure, what the strategy decided (auto-SAC's decisions follow its own timings)
    decided = [(m, sorted(r.cached)) for m, r in zip(imported.modules, imported.regions)]
    differ = [k for k in grads0 if not torch.equal(grads[k], grads0[k])]
    if imported.differs:  # its own recompute draws other numbers: predicted, so checked
        assert differ, f"predicted {imported.differs}, yet gradients equal\n{decided}"
    else:
        assert not differ, f"gradients differ: {differ}\ndecided (region, cached ops): {decided}"
    timeline = imported.timeline
    assert max(s.live for s in timeline) == imported.prediction.peak
    return imported


@pytest.mark.parametrize("name", MODELS)
def test_hf_checkpointing_exact(one_thread, name: str) -> None:
    imported = _check(name, lambda p, *_: strategies.hf_checkpointing(p))
    assert len(imported.modules) == 2 and imported.prediction.overhead > 1


def test_diffusers_checkpointing_exact(one_thread) -> None:
    """diffusers' `enable_gradient_checkpointing()`: its blocks checkpoint their resnets (the
    mid block's first one aside), found by a recording run."""
    imported = _check("diffusers-unet", lambda p, *_: strategies.hf_checkpointing(p))
    assert "mid_block.resnets.1" in imported.modules
    assert "mid_block.resnets.0" not in imported.modules


@pytest.mark.parametrize("name", MODELS)
def test_torchtitan_selective_exact(one_thread, name: str) -> None:
    imported = _check(name, lambda p, *_: strategies.torchtitan_selective(p))
    assert all(not r.early_stop for r in imported.regions)
    assert any(r.cached for r in imported.regions)  # it saves its matmuls


@pytest.mark.parametrize("name", [*MODELS, "diffusers-unet"])
def test_torchtune_offload_exact(one_thread, name: str) -> None:
    imported = _check(name, lambda p, *_: strategies.torchtune_offload(p))
    assert imported.offloaded and not imported.regions
    assert any(s.label == "prefetch" for s in imported.timeline)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "budget"), [("gpt-tiny", 0.6), ("hf-gpt2-d128", 0.8)])
def test_autosac_exact(one_thread, name: str, budget: float) -> None:
    """auto-SAC's own solve (~15 s: its estimators time every op for real); the budgets are
    ones its ILP can meet on these 2-layer models (not 50%: `sac_milp` is infeasible)."""

    def make(problem, model, args, kwargs, targets):  # noqa: ANN001, ANN202
        return strategies.autosac(problem, budget, args, kwargs, targets)

    imported = _check(name, make)
    assert imported.modules and imported.bound is not None


# a layer's three CPU dropouts (`empty_like`, `bernoulli_`, `div_` each), which nodes of each
# the policy saves: (nodes saved per dropout, gradients equal to eager's)
RANDOM_DECISIONS = [
    (((), (), ()), True),
    (((0, 1, 2), (), ()), False),  # the first saved, the second redrawn: shifted draws
    (((), (0, 1, 2), (0, 1, 2)), True),  # saved only after the last redraw
    (((0,), (), ()), True),  # its buffer from the cache, rewritten in full
    (((), (), (1, 2)), False),  # the in-place writes saved: the buffer stays unwritten
    (((), (), (0, 2)), False),  # `div_` saved: the rewritten buffer stays undivided
]


@pytest.mark.slow
def test_autosac_random_rule_predicts_its_gradients(one_thread) -> None:
    """auto-SAC's per-op decisions can save part of a dropout, or a dropout before one that
    is redrawn; its own recompute then gives other gradients. `differs` says so exactly when
    they do (the rule behind the test above, where auto-SAC's timings pick the decisions)."""
    model, args, kwargs, loss_fn, targets = _case("hf-gpt2-d128")
    problem = core.analyze(model, args, kwargs, loss_fn, targets)
    _, _, grads0 = step(model, model, args, kwargs, loss_fn, targets)
    layers = strategies.decoder_layers(model)
    graph, nodes = problem.graph, problem.graph.trace.nodes
    op_of = {n: op.index for op in graph.ops for n in op.nodes}
    counted = [
        n
        for n in strategies.policy_ops(problem, layers[0])
        if nodes[n].target not in strategies._AUTOSAC_SKIPPED
    ]
    random = [k for k, n in enumerate(counted) if n in op_of and graph.ops[op_of[n]].random]
    assert len(random) == 9  # attention, residual and MLP dropouts
    for saves, equal in RANDOM_DECISIONS:
        decided = [0] * len(counted)
        for dropout, members in enumerate(saves):
            for m in members:
                decided[random[3 * dropout + m]] = 1
        solution = strategies.AutoSacSolution(
            {}, {layer: tuple(decided) for layer in layers}, 0.0, 0, 0
        )
        imported = strategies.autosac_imported(problem, layers, solution, 0)
        peak, _, grads = step(model, imported.step(model), args, kwargs, loss_fn, targets)
        assert peak == imported.prediction.peak + 4, saves
        same = all(torch.equal(grads[k], grads0[k]) for k in grads0)
        assert same == equal, (saves, imported.differs)
        assert bool(imported.differs) == (not equal), (saves, imported.differs)


def test_titan_rule() -> None:
    """torchtitan's rule: save matmuls (every second `mm` recomputed), attention kernels and
    `max`; recompute the rest."""
    ops = [aten.mm.default, aten.relu.default, aten.mm.default, aten.addmm.default]
    ops += [aten.mm.default, aten.max.default, aten.bmm.default, aten.mm.default]
    assert strategies.titan_saves(ops) == [True, False, False, True, True, True, True, False]


def test_no_layers_refused() -> None:
    with pytest.raises(strategies.NotApplicable, match="no decoder layers"):
        strategies.decoder_layers(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
