"""The ``flashoverlap`` command: one subcommand per job, each in its own module.

A subcommand's module has ``configure(parser)``, which adds its options, and ``run(args)``,
which does the job and returns the exit status. Adding a subcommand is one line in
:data:`COMMANDS`.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__

# name -> (module with configure(parser) and run(args), one-line help)
COMMANDS = {
    "bench": ("flashoverlap_core.bench",
              "the main job: time overlapped GEMM + collective against the plain sequence "
              "on every device (or 2 CPU ranks) and check that the results agree"),
    "report": ("flashoverlap_core.report",
               "list every backend, whether it is available here and why not, and versions"),
    "build": ("flashoverlap_core.prebuild",
              "compile every backend's kernels ahead of time into the kernel cache"),
    "tune": ("flashoverlap_core.tuning.tune_cli",
             "choose the wave groups of each shape and store them in the tuning cache"),
    "trace": ("flashoverlap_core.tuning.trace_cli",
              "run one overlapped call and draw its timeline"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
