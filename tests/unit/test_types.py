"""reflow_hpc/core/ type-checks clean under the settings of pyproject.toml's ``[tool.mypy]`` (mypy's
strict set on core's modules): ``mypy reflow_hpc/core``, run from the repository root."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed (pip install -e '.[dev]')")
def test_core_type_checks_clean():
    proc = subprocess.run([sys.executable, "-m", "mypy", "reflow_hpc/core"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"mypy reflow_hpc/core:\n{proc.stdout}{proc.stderr}"
