"""``flashoverlap build``: compile every backend's kernels ahead of time.

Useful before a job starts (no JIT compile inside the first call), on a machine without the
device (the objects go to the kernel cache, which can be copied to the machines that run), or
with JIT forbidden at run time.
"""
from __future__ import annotations

import argparse
import time

from .. import registry


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append",
                        help="only this backend (repeatable; default: every installed backend)")
    parser.add_argument("--arch", type=int, action="append",
                        help="device generation to build for, in the backend's naming "
                             "(e.g. 90, 80); repeatable; default: all it supports")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles")


def run(args) -> int:
    names = args.backend or [s.name for s in registry.backends()]
    failed = 0
    for name in names:
        backend, why = registry.load(name)
        if backend is None:
            print(f"{name}: not loadable ({why})")
            failed += 1
            continue
        start = time.monotonic()
        try:
            paths = backend.prebuild(archs=args.arch, jobs=args.jobs)
        except Exception as e:  # report per backend, go on with the others
            print(f"{name}: build failed: {type(e).__name__}: {e}")
            failed += 1
            continue
        print(f"{name}: {len(paths)} object(s) in {time.monotonic() - start:.0f} s")
        for path in paths:
            print(f"  {path}")
    return 1 if failed else 0
