"""Every experiments/ entry point imports on its own: absl flags defined twice (a module and one it imports
both defining --tunings, say) fail at import, before any work."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_entry_point_imports(module):
    run = subprocess.run([sys.executable, "-c", f"import experiments.{module}"], cwd=ROOT, capture_output=True,
                         text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"}, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
