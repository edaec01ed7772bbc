"""Ops called through their Python bindings: bit-identical to eager, same overload each time."""

import pytest
import torch
from helpers import fresh

import core
from core.interpret import binding
from core.trace import AtenNode, Ref, TensorSpec

aten = torch.ops.aten


def _step(model, inputs, run):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = run(*inputs)
    loss.backward()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return loss.detach(), [p.grad.clone() for p in model.parameters()], state, torch.get_rng_state()


@pytest.mark.parametrize("name", ["gpt-tiny", "resnet-tiny"])
def test_recomputing_plan_is_bit_identical_to_eager(name):
    """Dropout replayed and batch-norm statistics updated once: equal to the bit, not close."""
    model, inputs = fresh(name)
    plan = core.solve(core.analyze(model, inputs), 1.0, method="sqrt_n")
    assert plan.recomputed_ops > 0
    start = {k: v.clone() for k, v in model.state_dict().items()}
    eager = _step(model, inputs, model)
    model.load_state_dict(start)
    planned = _step(model, inputs, core.apply_plan(model, plan))
    assert torch.equal(planned[0], eager[0])
    assert all(torch.equal(a, b) for a, b in zip(planned[1], eager[1], strict=True))
    assert all(torch.equal(planned[2][k], eager[2][k]) for k in eager[2])
    assert torch.equal(planned[3], eager[3])


def _nodes(target, *args) -> list[AtenNode]:
    x = AtenNode(0, "x", "input", specs=(TensorSpec((2, 3), "float32"),), strides=((3, 1),))
    return [x, AtenNode(1, "y", "op", target=target, args=(Ref(0), *args))]


def test_binding_is_used_only_where_it_dispatches_the_same_overload():
    nodes = _nodes(aten.sum.dim_IntList, [1], False)
    assert binding(nodes[1], nodes, {}) is torch._C._VariableFunctions.sum
    nodes = _nodes(aten.view.default, [3, 2])
    assert binding(nodes[1], nodes, {}) is torch._C.TensorBase.view
    nodes = _nodes(aten.add.Scalar, 2)  # torch.add(x, 2) would call add.Tensor
    assert binding(nodes[1], nodes, {}) is aten.add.Scalar._op


def test_fast_calls_build_the_same_arguments():
    """Each shape `Call.fast` specialises (references first, then constants and keywords)
    passes exactly the arguments the general path builds."""
    from core.interpret import compile_node

    seen = []

    def record(*args, **kwargs):
        seen.append((args, kwargs))

    env = {0: "a", 1: "b", 2: "c", 3: "d"}
    shapes = [
        ((Ref(0),), {}),
        ((Ref(0), [3, 2]), {}),
        ((Ref(0), Ref(1)), {"alpha": 2}),
        ((Ref(0), Ref(1), Ref(2)), {}),
        ((Ref(0), Ref(1), Ref(2), 1.5), {}),
        ((Ref(0), 1, Ref(1)), {}),  # a reference after a constant: the general path
        ((Ref(0), Ref(1), Ref(2), Ref(3)), {}),  # four references: the general path
        (([Ref(0), Ref(1)], 0), {}),  # a list of references (cat): the general path
    ]
    for args, kwargs in shapes:
        node = AtenNode(9, "y", "op", target=record, args=args, kwargs=kwargs)
        call = compile_node(node)
        seen.clear()
        call.fast()(env)
        call(env)
        assert seen[0] == seen[1]
        assert seen[0][0][0] in ("a", ["a", "b"])
    specialised = [
        compile_node(AtenNode(9, "y", "op", target=record, args=a, kwargs=k)) for a, k in shapes
    ]
    assert [c.fast() is not c for c in specialised] == [True] * 5 + [False] * 3
