"""The README's code runs as it is written there (each block is read from README.md, so the
two cannot drift): the example backend of "Writing a backend" passes the conformance suite,
and the API snippet runs at world size 1 and on two ranks."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flashoverlap_core.tools.ranks import RankPool
from suite_runner import describe, run_suite, summary

README = Path(__file__).resolve().parents[1] / "README.md"


def python_block(containing: str) -> str:
    """The one ```python block of the README that contains ``containing``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
              if containing in b]
    assert len(blocks) == 1, f"expected one python block with {containing!r} in README.md"
    return blocks[0]


@pytest.mark.timeout(600)
def test_the_example_backend_passes_the_suite(tmp_path):
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "backend.py").write_text(python_block("class MyBackend"))
    # as the README says: before it is installed, the suite loads it by its path
    result = run_suite("my_package.backend:MyBackend", "--fo-world-sizes", "1,2", "-rs",
                       timeout=540, paths=(str(tmp_path),))
    counts = summary(result)
    assert result.returncode == 0 and counts.get("passed", 0) >= 100, describe(result)
    # every skip is a call the example declines, with its own reason
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    assert len(skips) >= 1, describe(result)
    assert all("no float16 kernel" in s or "waits for arriving rows" in s for s in skips), \
        "\n".join(s for s in skips if "float16" not in s and "arriving rows" not in s)


def run_snippet(code: str) -> None:
    """The snippet on this rank, printing nothing."""
    exec(compile(code, "README.md (API)", "exec"), {"print": lambda *a, **k: None})


@pytest.mark.timeout(300)
def test_the_api_snippet_runs_in_one_process():
    env = {k: v for k, v in os.environ.items() if k != "FLASHOVERLAP_BACKEND"}
    done = subprocess.run([sys.executable, "-c", python_block("fo.overlap(a, weight.t()")],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reference" in done.stdout and "allreduce" in done.stdout  # backends, describe()


@pytest.mark.timeout(300)
def test_the_api_snippet_runs_on_two_ranks():
    with RankPool(2, "cpu", timeout=240) as pool:
        pool.run(run_snippet, python_block("fo.overlap(a, weight.t()"))
