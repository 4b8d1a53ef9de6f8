"""Every document the repository cites exists: a ``something.md`` named in code, scripts or
documents is a file, found from the repository root or beside the citing file."""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".cu", ".cuh", ".h", ".sh", ".md", ".toml", ".ini", ".cfg"}
SKIP = {".git", ".venv", ".tox", "build", "dist", "results", "__pycache__"}
CITED = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")


def sources():
    """The repository's code, scripts and documents (not environments, builds or results)."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder, name)
            if path.suffix in SUFFIXES and path != Path(__file__).resolve():
                yield path


def test_every_cited_document_exists():
    missing = []
    for path in sorted(sources()):
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for cited in CITED.findall(line):
                if not ((ROOT / cited).is_file() or (path.parent / cited).is_file()):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {cited}")
    assert not missing, "cited documents that do not exist:\n" + "\n".join(missing)


def test_the_check_finds_citations():
    assert CITED.findall("see docs/design.md, 'Layers' (and DESIGN.md)") == ["docs/design.md",
                                                                           "DESIGN.md"]
    assert CITED.findall("https://example.org/a.md x.mdx") == []
