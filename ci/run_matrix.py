#!/usr/bin/env python3
"""Run each vendor tox env whose hardware is here; say per env whether it ran and passed.

An env runs when its backend is available (``flashoverlap_core.backends()``); otherwise it is
skipped with the backend's reason. A backend that does not even load is a failure: a backend
must import cleanly everywhere and say in ``probe()`` what is missing. Exit status 1 when any
env that ran failed (or could not load its backend), else 0.

    python ci/run_matrix.py [ENV ...] [-- PYTEST ARGS]     (default envs: cuda ascend; add cpu)
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR_ENVS = ("cuda", "ascend")  # tox env name == backend name
SUMMARY = re.compile(r"=+ (.*\d+ (passed|failed|error|errors|skipped|deselected).*) in [\d.]+s")


def backend_status() -> dict:
    try:
        import flashoverlap_core as fo
    except ImportError as e:
        raise SystemExit(f"run_matrix: {e}: install the package here first (pip install -e .)")

    return {s.name: s for s in fo.backends()}


def tox_command() -> list[str] | None:
    if shutil.which("tox"):
        return ["tox"]
    probe = subprocess.run([sys.executable, "-m", "tox", "--version"], capture_output=True)
    return [sys.executable, "-m", "tox"] if probe.returncode == 0 else None


def run_env(tox: list[str], env: str, pytest_args: list[str]) -> tuple[int, str]:
    """Run ``tox -e env``, echoing its output; (exit status, pytest's summary line)."""
    cmd = tox + ["-e", env] + (["--"] + pytest_args if pytest_args else [])
    print(f"+ {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    tail = deque(maxlen=200)
    for line in proc.stdout:
        sys.stdout.write(line)
        tail.append(line)
    status = proc.wait()
    summaries = [m.group(1) for m in map(SUMMARY.search, tail) if m]
    return status, summaries[-1] if summaries else "no pytest summary"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    pytest_args = argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="arguments after -- go to pytest")
    parser.add_argument("envs", nargs="*", default=list(VENDOR_ENVS),
                        help=f"tox envs (default: {' '.join(VENDOR_ENVS)}; 'cpu' always runs)")
    args = parser.parse_args(argv[:cut])

    statuses, tox = backend_status(), tox_command()
    lines, failed = [], False
    for env in args.envs:
        status = statuses.get(env)
        if env != "cpu" and (status is None or not status.available):
            why = status.reason if status else "no such backend is installed"
            if why.startswith("failed to load"):
                lines.append(f"{env}: FAILED: the backend does not load: {why}")
                failed = True
            else:
                lines.append(f"{env}: skipped: {why}")
            continue
        if tox is None:
            lines.append(f"{env}: FAILED: hardware present but tox is not installed (pip install tox)")
            failed = True
            continue
        code, summary = run_env(tox, env, pytest_args)
        lines.append(f"{env}: ran, {'passed' if code == 0 else f'FAILED (exit {code})'}: {summary}")
        failed |= code != 0
    print("\nmatrix:\n" + "\n".join("  " + line for line in lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
