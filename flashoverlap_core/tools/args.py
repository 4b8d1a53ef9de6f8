"""Command-line arguments the tools share: shapes, lists of ints and ops, and the usage error.

Each ``*_arg`` function is an argparse ``type=``: a bad value ends the command with one line
naming the option and exit status 2, before any rank starts. A problem found later, while still
checking arguments, is a :class:`UsageError`, which ``flashoverlap`` reports the same way.
"""
from __future__ import annotations

import argparse


class UsageError(ValueError):
    """A bad argument found after parsing: one line and exit status 2."""


def shape_arg(text: str) -> tuple[int, int, int]:
    """One MxNxK shape (M, N, K >= 1)."""
    parts = text.strip().lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is MxNxK with M, N, K >= 1 "
                                         f"(e.g. 1024x1024x512), got {text!r}")
    m, n, k = (int(p) for p in parts)
    return m, n, k


def shapes_arg(text: str) -> list[tuple[int, int, int]]:
    """Comma-separated MxNxK shapes, at least one."""
    shapes = [shape_arg(s) for s in text.split(",") if s.strip()]
    if not shapes:
        raise argparse.ArgumentTypeError(f"expected comma-separated MxNxK shapes, got {text!r}")
    return shapes


def ints_arg(text: str) -> tuple[int, ...]:
    """Comma-separated ints >= 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def choices_arg(choices: tuple[str, ...]):
    """The type of comma-separated names out of ``choices`` (at least one)."""
    def parse(text: str) -> list[str]:
        names = [o.strip() for o in text.split(",") if o.strip()]
        unknown = [o for o in names if o not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"expected names out of {', '.join(choices)}, "
                                             f"got {text!r}")
        return names
    return parse


def at_least(minimum: int):
    """The type of one int >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}")
        return value
    return parse


def add_dtype_options(parser: argparse.ArgumentParser) -> None:
    """``--dtype`` and, for fp8, ``--scaling`` (the kind of the scales the calls take)."""
    from ..plan import DTYPES, SCALINGS

    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="default: float32 on the CPU, bfloat16 on accelerators; "
                        "float8_e4m3fn: e4m3 inputs with float32 scales, bfloat16 results")
    parser.add_argument("--scaling", choices=SCALINGS,
                        help="fp8 only: the scales' kind (default: rowwise; tensorwise shares "
                        "its plans; blockwise has plans of its own)")


def dtype_and_scaling(args: argparse.Namespace, on_cpu: bool) -> tuple[str, str | None]:
    """The job's dtype and (fp8) scaling from ``add_dtype_options``'s arguments; a
    :class:`UsageError` for ``--scaling`` without an fp8 dtype."""
    from ..plan import FP8_DTYPES

    dtype = args.dtype or ("float32" if on_cpu else "bfloat16")
    if dtype in FP8_DTYPES:
        return dtype, args.scaling or "rowwise"
    if args.scaling is not None:
        raise UsageError(f"--scaling is for fp8 ({', '.join(FP8_DTYPES)}), not --dtype {dtype}")
    return dtype, None
