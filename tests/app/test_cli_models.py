"""The MODEL argument as the installed `remat` console script resolves it: a
`module:callable` next to the working directory imports, as it would under `python -m`, and a
module that is really missing gets an error saying where it was looked for and what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.models import ModelSpecError, resolve_builder

REPO = Path(__file__).resolve().parents[2]

# What pip writes for `[project.scripts] remat = "app.cli:main"`: run as a file, it puts its
# own folder, not the working directory, at sys.path[0].
CONSOLE_SCRIPT = """import sys
from app.cli import main
if __name__ == '__main__':
    sys.argv[0] = sys.argv[0].removesuffix('.exe')
    sys.exit(main())
"""

MYMODS = """import torch
from torch import nn


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x).square().mean()

    return Step(), (torch.randn(4, 8),)
"""


def _remat(tmp_path: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "remat"
    script.write_text(CONSOLE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, str(script), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_console_script_imports_a_model_module_from_the_working_directory(tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "mymods.py").write_text(MYMODS)
    result = _remat(tmp_path, work, "inspect", "mymods:build")
    assert result.returncode == 0, result.stderr
    assert "mymods:build" in result.stdout


@pytest.mark.slow
def test_a_missing_model_module_says_where_it_looked(tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    result = _remat(tmp_path, work, "inspect", "nosuchmods:build")
    assert result.returncode == 2
    err = result.stderr
    assert "no module named 'nosuchmods'" in err
    assert str(work) in err
    assert "nosuchmods.py" in err and "PYTHONPATH" in err


@pytest.mark.slow
def test_a_missing_dependency_of_the_model_module_is_named(tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "needsdep.py").write_text("import no_such_dependency_xyz\n")
    result = _remat(tmp_path, work, "inspect", "needsdep:build")
    assert result.returncode == 2
    assert "no_such_dependency_xyz" in result.stderr
    assert "install what it imports" in result.stderr


def test_zoo_names_of_each_library_build_the_model_as_its_users_call_it():
    """`hf-`, `timm-` and `diffusers-` names load their zoo (keyword inputs, the loss
    outside); an unknown name in a zoo lists that zoo's models."""
    call = resolve_builder("diffusers-unet-cond")()
    assert set(call.kwargs) >= {"sample", "timestep", "encoder_hidden_states"}
    assert call.loss_fn is not None and call.targets
    assert type(resolve_builder("timm-vit")().model).__module__.startswith("timm.")
    assert type(resolve_builder("hf-gpt2")().model).__name__ == "GPT2LMHeadModel"
    with pytest.raises(ModelSpecError, match="timm-resnet, timm-vit, timm-efficientnet"):
        resolve_builder("timm-nope")
