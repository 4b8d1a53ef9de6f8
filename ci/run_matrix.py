#!/usr/bin/env python3
"""Run each vendor env whose hardware is here; say per env whether it ran and passed.

A vendor env (``cuda``, ``ascend``) runs the command of its ``[testenv:NAME]`` in tox.ini
(the conformance suite against that backend, hardware skips turned into failures) with this
interpreter, ``sys.executable``: the Python that has the vendor's torch, whether a virtual
environment, conda or the system's. An env runs when its backend is available to this
interpreter (``flashoverlap_core.backends()``); otherwise it is skipped with the backend's
reason. A backend that does not even load is a failure: a backend must import cleanly
everywhere and say in ``probe()`` what is missing. ``cpu`` runs ``tox -e cpu`` (a fresh
environment with the CPU build of torch). Exit status 1 when any env that ran failed (or could
not load its backend), else 0.

    python ci/run_matrix.py [--dry-run] [ENV ...] [-- PYTEST ARGS]   (default envs: cuda ascend)
"""
from __future__ import annotations

import argparse
import configparser
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENDOR_ENVS = ("cuda", "ascend")  # tox env name == backend name
TEST_MODULES = ("pytest", "pytest_timeout", "hypothesis")  # the test extra's, as imported
SUMMARY = re.compile(r"=+ (.*\d+ (passed|failed|error|errors|skipped|deselected).*) in [\d.]+s")


def backend_status() -> dict:
    try:
        import flashoverlap_core as fo
    except ImportError as e:
        raise SystemExit(f"run_matrix: {e}: install the package here first (pip install -e .)")

    return {s.name: s for s in fo.backends()}


def interpreter() -> str:
    """This Python and what kind of environment it is."""
    if os.environ.get("CONDA_PREFIX") == sys.prefix or (Path(sys.prefix) / "conda-meta").is_dir():
        kind = "conda"
    elif sys.prefix != sys.base_prefix:
        kind = "a virtual environment"
    else:
        kind = "the system's"
    return f"{sys.executable} ({kind})"


def env_command(env: str, pytest_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The pytest command of tox.ini's ``[testenv:env]`` as this interpreter runs it, and the
    variables its ``setenv`` sets."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(ROOT / "tox.ini")
    section = config[f"testenv:{env}"]
    words = shlex.split(section["commands"])
    if words[0] != "pytest":
        raise SystemExit(f"run_matrix: tox.ini's [testenv:{env}] command is not pytest: {words}")
    args = [w for w in words[1:] if w != "{posargs}"]
    variables = {}
    for line in section.get("setenv", "").splitlines():
        name, sep, value = line.partition("=")
        if sep:
            variables[name.strip()] = value.strip()
    return [sys.executable, "-m", "pytest", *args, *pytest_args], variables


def tox_command() -> list[str] | None:
    if shutil.which("tox"):
        return ["tox"]
    probe = subprocess.run([sys.executable, "-m", "tox", "--version"], capture_output=True)
    return [sys.executable, "-m", "tox"] if probe.returncode == 0 else None


def run(cmd: list[str], variables: dict[str, str]) -> tuple[int, str]:
    """Run ``cmd`` with ``variables`` set, echoing its output; (exit status, pytest's summary
    line)."""
    shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
    print(f"+ {shown + ' ' if shown else ''}{shlex.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **variables})
    tail = deque(maxlen=200)
    for line in proc.stdout:
        sys.stdout.write(line)
        tail.append(line)
    status = proc.wait()
    summaries = [m.group(1) for m in map(SUMMARY.search, tail) if m]
    return status, summaries[-1] if summaries else "no pytest summary"


def vendor_env(env: str, status, pytest_args: list[str], dry_run: bool) -> tuple[bool, str]:
    """Run one vendor env here if its backend is available: (failed, its summary line)."""
    if status is None or not status.available:
        why = status.reason if status else "no such backend is installed"
        if why.startswith("failed to load"):
            return True, f"{env}: FAILED: the backend does not load: {why}"
        return False, f"{env}: skipped: {why}"
    missing = [m for m in TEST_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return True, (f"{env}: FAILED: {interpreter()} has the {env} backend but not the test "
                      f"modules {missing}: pip install -e '.[test,{env}]' with it")
    cmd, variables = env_command(env, pytest_args)
    if dry_run:
        shown = " ".join(f"{k}={v}" for k, v in variables.items())
        return False, f"{env}: would run with {interpreter()}: {shown} {shlex.join(cmd)}"
    code, summary = run(cmd, variables)
    verdict = "passed" if code == 0 else f"FAILED (exit {code})"
    return code != 0, f"{env}: ran with {interpreter()}, {verdict}: {summary}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    pytest_args = argv[cut + 1:]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="arguments after -- go to pytest")
    parser.add_argument("envs", nargs="*", default=list(VENDOR_ENVS),
                        help=f"envs (default: {' '.join(VENDOR_ENVS)}; 'cpu': tox -e cpu)")
    parser.add_argument("--dry-run", action="store_true",
                        help="say what each env would run, and run nothing")
    args = parser.parse_args(argv[:cut])

    statuses = backend_status()
    lines, failed = [], False
    for env in args.envs:
        if env != "cpu":
            env_failed, line = vendor_env(env, statuses.get(env), pytest_args, args.dry_run)
        elif args.dry_run:
            env_failed, line = False, "cpu: would run tox -e cpu"
        elif (tox := tox_command()) is None:
            env_failed, line = True, "cpu: FAILED: tox is not installed (pip install tox)"
        else:
            code, summary = run(tox + ["-e", "cpu", "--", *pytest_args], {})
            env_failed = code != 0
            verdict = "passed" if code == 0 else f"FAILED (exit {code})"
            line = f"cpu: ran tox -e cpu, {verdict}: {summary}"
        lines.append(line)
        failed |= env_failed
    print("\nmatrix:\n" + "\n".join("  " + line for line in lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
