"""The private PyTorch APIs the engine relies on (`core.private_api`): each still resolves in
the installed torch, and docs/architecture.md lists each. A torch upgrade that removes one
fails here, naming it, before it fails somewhere deep in a trace."""

from pathlib import Path

import pytest

from core.private_api import PRIVATE_APIS, PrivateAPI, missing

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_every_private_torch_api_the_engine_uses_resolves():
    gone = [f"{api.name} (used in {api.used_in}: {api.why})" for api in missing()]
    assert not gone, "torch no longer has: " + "; ".join(gone)


def test_a_removed_api_is_named():
    fake = PrivateAPI("torch.utils.checkpoint", "_no_such_generator", "here", "a test")
    assert not fake.resolves()
    assert PrivateAPI("torch.no_such_module", "x", "here", "a test").resolves() is False


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda api: api.name)
def test_the_architecture_doc_lists_it(api):
    assert f"`{api.name}`" in DOC.read_text(), f"docs/architecture.md does not list {api.name}"
