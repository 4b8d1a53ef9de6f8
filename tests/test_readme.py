"""The README's code runs as it is written there (each block is read from the document, so the
two cannot drift): the API snippet runs at world size 1 and on two ranks (tests/test_nn.py runs
the "In a model" snippet), the scripts of examples/ hold those blocks as they are and run alone
(ci/examples.sh runs them under torchrun), and the example backend of docs/backends.md passes
the conformance suite. Every figure the README shows and every result file it names exists, each figure's source
file (bench/plots.py writes it into the PNG) is the one the README names, and every link into a
document points at a heading there."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from suite_runner import describe, run_suite, summary
from test_torch_ops_ranks import ranks as shared_ranks

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BACKENDS = ROOT / "docs/backends.md"


def python_block(containing: str, document: Path = README) -> str:
    """The one ```python block of ``document`` (the README) that contains ``containing``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", document.read_text(), re.S)
              if containing in b]
    assert len(blocks) == 1, f"expected one python block with {containing!r} in {document.name}"
    return blocks[0]


@pytest.mark.timeout(600)
def test_the_example_backend_passes_the_suite(tmp_path):
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "backend.py").write_text(python_block("class MyBackend", BACKENDS))
    # as docs/backends.md says: before it is installed, the suite loads it by its path
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


# examples/ script -> the README block it holds (None: no README block)
EXAMPLES = {"api.py": "fo.overlap(a, weight.t()",
            "in_a_model.py": "fo.nn.ColumnParallelLinear.from_linear", "llama.py": None}


def test_the_examples_hold_the_readme_blocks_as_they_are():
    assert sorted(EXAMPLES) == sorted(p.name for p in (ROOT / "examples").glob("*.py")
                                      if p.name != "launch.py")
    for name, block in EXAMPLES.items():
        if block is not None:
            assert python_block(block) in (ROOT / "examples" / name).read_text(), name


def run_example(name: str) -> subprocess.CompletedProcess:
    """``python examples/NAME`` as a user runs it: alone, with no backend named."""
    env = {k: v for k, v in os.environ.items() if k not in ("FLASHOVERLAP_BACKEND", "WORLD_SIZE")}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name)], capture_output=True,
                          text=True, timeout=240, env=env)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["api.py", pytest.param("in_a_model.py", marks=pytest.mark.full),
                                  pytest.param("llama.py", marks=pytest.mark.full)])
def test_an_example_runs_alone_at_world_size_1(name):
    if name == "llama.py":
        pytest.importorskip("transformers", reason="examples/llama.py needs the examples extra "
                                                   "(pip install -e '.[examples]')")
    done = run_example(name)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "example: rank 0 of 1: " in done.stdout, done.stdout[-3000:]
    if name == "api.py":  # the README block's own output: the backends and describe()
        assert "reference" in done.stdout and "allreduce" in done.stdout


@pytest.mark.timeout(300)
def test_the_api_snippet_runs_on_two_ranks():
    shared_ranks(2).run(run_snippet, python_block("fo.overlap(a, weight.t()"), timeout=240)


def test_the_readme_shows_the_two_commands():
    text = README.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert any("pip install -e '.[test]' && flashoverlap bench" in b for b in blocks), blocks
    assert any("pytest" in b.splitlines() for b in blocks), blocks  # ci/cpu.sh greps for it


def test_every_figure_and_result_file_the_readme_names_exists():
    text = README.read_text()
    figures = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    results = set(re.findall(r"[\w.-]+\.(?:json|txt|png)", text)) - {Path(f).name for f in figures}
    assert figures and results, "the README shows no figure or names no result file"
    assert all((ROOT / f).is_file() for f in figures), [f for f in figures if not (ROOT / f).is_file()]
    missing = [r for r in sorted(results) if not (ROOT / "bench" / "results" / r).is_file()
               and not (ROOT / r).is_file()]
    assert not missing, f"result files named in README.md that bench/results/ lacks: {missing}"


def test_each_figure_comes_from_the_file_the_readme_names():
    from PIL import Image

    for figure in re.findall(r"!\[[^\]]*\]\((docs/img/[^)\s]+\.png)\)", README.read_text()):
        with Image.open(ROOT / figure) as png:
            source = png.text.get("Source")
        assert source, f"{figure} names no source file: draw it with bench/plots.py"
        assert (ROOT / source).is_file(), f"{figure}: its source {source} does not exist"
        assert Path(source).name in README.read_text(), \
            f"{figure} is drawn from {source}, which README.md does not name: update its caption"


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_into_a_document_finds_its_heading():
    broken = []
    for source in (README, ROOT / "docs/results.md", BACKENDS):
        for target, name in re.findall(r"\]\(([\w./-]*\.md)?#([\w-]+)\)", source.read_text()):
            document = (source.parent / target) if target else source
            prose = re.sub(r"```.*?```", "", document.read_text(), flags=re.S)
            headings = re.findall(r"^#+ (.+)$", prose, re.M)
            if name not in {anchor(h) for h in headings}:
                broken.append(f"{source.relative_to(ROOT)}: {target}#{name}")
    assert not broken, f"links to headings that do not exist: {broken}"
