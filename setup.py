"""Package discovery that pyproject.toml cannot express (all other metadata is there).

The folders ``backends/`` and ``csrc/`` install as the packages ``flashoverlap_backends`` and
``flashoverlap_csrc``, each with every subpackage it holds, so a vendor's backend is packaged as
soon as its folder has an ``__init__.py`` and a missing one breaks nothing. ``csrc/`` holds
sources, not Python: its subfolders are data (namespace) packages.
"""
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup

ROOT = Path(__file__).resolve().parent
PACKAGE_DIRS = {"flashoverlap_core": "flashoverlap_core", "flashoverlap_backends": "backends",
                "flashoverlap_csrc": "csrc"}


def packages(name: str, folder: str) -> list[str]:
    find = find_namespace_packages if name == "flashoverlap_csrc" else find_packages
    found = find(str(ROOT / folder), exclude=["*__pycache__*"])
    return [name] + [f"{name}.{sub}" for sub in found]


setup(package_dir=PACKAGE_DIRS,
      packages=[p for name, folder in PACKAGE_DIRS.items() for p in packages(name, folder)])
