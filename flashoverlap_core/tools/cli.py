"""The ``flashoverlap`` command: one subcommand per job, each in its own module.

A subcommand's module has ``configure(parser)``, which adds its options, and ``run(args)``,
which does the job and returns the exit status. Adding a subcommand is one line in
:data:`COMMANDS`. A bad argument, whether argparse or the command finds it, ends the command
with one line on stderr and exit status 2, before any rank starts.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from .. import __version__
from ..registry import BackendError
from .args import UsageError

# name -> (module with configure(parser) and run(args), one-line help)
COMMANDS = {
    "bench": ("flashoverlap_core.tools.bench",
              "the main job: time overlapped GEMM + collective against the plain sequence "
              "on every device (or 2 CPU ranks) and check that the results agree"),
    "report": ("flashoverlap_core.tools.report",
               "list every backend, whether it is available here and why not, and versions"),
    "build": ("flashoverlap_core.tools.build",
              "compile every backend's kernels ahead of time into the kernel cache"),
    "tune": ("flashoverlap_core.tools.tune",
             "choose the wave groups of each shape and store them in the tuning cache"),
    "trace": ("flashoverlap_core.tools.trace",
              "run one overlapped call and draw its timeline"),
}


class Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported on one line (not the usage text first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="flashoverlap",
        description="FlashOverlap: overlap a GEMM with the collective communication of its output.")
    parser.add_argument("--version", action="version", version=f"flashoverlap {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log which backend is chosen and why")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        module = importlib.import_module(module_name)
        command = sub.add_parser(name, help=summary, description=summary)
        module.configure(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(message)s")
    try:
        return args.run(args)
    except (UsageError, BackendError) as e:
        first, _, rest = str(e).partition("\n")  # a BackendError goes on to list every backend
        print(f"flashoverlap {args.command}: error: {first}", file=sys.stderr)
        if rest:
            print(rest, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
