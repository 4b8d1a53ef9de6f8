"""What the tuning commands share: where their work runs, a progress bar, shape parsing."""
from __future__ import annotations

import argparse
import sys

from .. import registry
from ..backend import Backend
from ..bench import Hardware
from ..launch import RankPool


def shape_arg(text: str) -> tuple[int, int, int]:
    """argparse type of one MxNxK shape."""
    parts = text.strip().lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is MxNxK with M, N, K >= 1 "
                                         f"(e.g. 1024x1024x512), got {text!r}")
    m, n, k = (int(p) for p in parts)
    return m, n, k


def shapes_arg(text: str) -> list[tuple[int, int, int]]:
    """argparse type of comma-separated MxNxK shapes."""
    return [shape_arg(s) for s in text.split(",") if s.strip()]


def ints_arg(text: str) -> tuple[int, ...]:
    """argparse type of comma-separated positive ints."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def command_main(name: str, doc: str, configure, run, argv) -> int:
    """Run ``flashoverlap <name>`` from its module's configure/run (argv: its arguments)."""
    parser = argparse.ArgumentParser(prog=f"flashoverlap {name}", description=doc)
    configure(parser)
    return run(parser.parse_args(argv))


def require_trace(name: str, command: str) -> None:
    """Exit with a clear message when the backend cannot trace calls."""
    backend = registry.get(name)
    if type(backend).trace is Backend.trace:
        raise SystemExit(f"flashoverlap {command}: backend {name!r} does not implement "
                         "Backend.trace(), which tuning needs; try --backend reference")


class Ranks:
    """Where per-rank work runs: in this process (one rank, no process group) or on a pool of
    spawned ranks; :meth:`run` returns rank 0's result."""

    def __init__(self, hw: Hardware, timeout: float):
        self.timeout = timeout
        self.pool = RankPool(hw.world_size, hw.device_type, timeout=timeout) \
            if hw.world_size > 1 else None

    def run(self, fn, *args):
        if self.pool is None:
            return fn(*args)
        return self.pool.run(fn, *args, timeout=self.timeout)[0]

    def close(self) -> None:
        if self.pool is not None and self.pool.alive:
            self.pool.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Progress:
    """A one-line progress bar on stderr: ``begin(label)`` before a step, ``end()`` after."""

    def __init__(self, total: int, stream=None, width: int = 28):
        self.total, self.done, self.width = total, 0, width
        self.stream = stream or sys.stderr
        self.label = ""

    def _draw(self) -> None:
        filled = self.width * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.width - filled)
        line = f"\r[{bar}] {self.done}/{self.total} {self.label}"
        self.stream.write(line[:120].ljust(120))
        self.stream.flush()

    def add(self, steps: int) -> None:
        self.total += steps
        self._draw()

    def begin(self, label: str) -> None:
        self.label = label
        self._draw()

    def end(self) -> None:
        self.done += 1
        self._draw()

    def finish(self) -> None:
        self.label = "done"
        self._draw()
        self.stream.write("\n")
        self.stream.flush()
