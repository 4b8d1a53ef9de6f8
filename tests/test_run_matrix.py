"""ci/run_matrix.py runs a vendor env's command with the interpreter that starts it (a venv's
torch is not the system site-packages a tox env sees), only where that interpreter has the
backend, and prints a summary line per env."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from flashoverlap_core.registry import BackendStatus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def matrix():
    spec = importlib.util.spec_from_file_location("run_matrix", ROOT / "ci" / "run_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_vendor_env_is_its_tox_command_with_this_interpreter(matrix):
    for env in ("cuda", "ascend"):
        cmd, variables = matrix.env_command(env, ["-x", "-k", "W1"])
        assert cmd == [sys.executable, "-m", "pytest", "--pyargs", "flashoverlap_core.testing",
                       "--fo-backend", env, "-x", "-k", "W1"]
        assert variables == {"FLASHOVERLAP_REQUIRE_HW": "1"}


def test_the_summary_says_what_ran_where_and_why_not(matrix, monkeypatch, capsys):
    statuses = {"cuda": BackendStatus("cuda", "cuda", True, ""),
                "ascend": BackendStatus("ascend", "npu", False, "torch_npu is not installed")}
    ran = []
    monkeypatch.setattr(matrix, "backend_status", lambda: statuses)
    monkeypatch.setattr(matrix, "run", lambda cmd, variables: ran.append((cmd, variables))
                        or (0, "120 passed, 40 skipped"))
    assert matrix.main(["--", "-x"]) == 0
    assert ran == [matrix.env_command("cuda", ["-x"])]
    summary = capsys.readouterr().out.split("matrix:\n")[1]
    assert f"cuda: ran with {sys.executable} (" in summary and "passed: 120 passed" in summary
    assert "ascend: skipped: torch_npu is not installed" in summary

    assert matrix.main(["--dry-run", "cuda"]) == 0 and len(ran) == 1  # nothing run
    assert "FLASHOVERLAP_REQUIRE_HW=1 " + " ".join(matrix.env_command("cuda", [])[0]) in \
        capsys.readouterr().out

    monkeypatch.setattr(matrix, "run", lambda cmd, variables: (1, "1 failed, 119 passed"))
    assert matrix.main(["cuda"]) == 1
    assert "cuda: ran with" in capsys.readouterr().out


def test_a_backend_that_does_not_load_fails_the_matrix(matrix, monkeypatch, capsys):
    broken = BackendStatus("cuda", None, False, "failed to load x:Y: ImportError: no")
    monkeypatch.setattr(matrix, "backend_status", lambda: {"cuda": broken})
    assert matrix.main(["cuda"]) == 1
    assert "cuda: FAILED: the backend does not load" in capsys.readouterr().out
