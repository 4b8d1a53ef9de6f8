"""``flashoverlap report``: what this machine can run, and with which versions.

Every backend (name, device type, available or why not, devices), the versions each backend
reports (collective library, compiler, kernel headers: reported even where it cannot run, so a
missing piece shows), torch's collective library per device type, torch and Python. Nothing
here creates a device context.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

from .. import __version__, registry
from .table import format_table


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def collect() -> dict:
    """The report as plain data (also recorded with every benchmark result)."""
    backends = []
    for status in registry.backends():
        entry = {"name": status.name, "device_type": status.device_type,
                 "available": status.available, "reason": status.reason}
        backend, _ = registry.load(status.name)
        if backend is not None:
            # a backend's versions (its collective library, compiler, headers) say what it
            # would run with, so they are reported whether or not it can run here
            entry["versions"] = _guarded(backend.versions)
            if status.available and status.device_type not in (None, "cpu"):
                entry["device_count"] = _guarded(backend.device_count)
        backends.append(entry)
    return {
        "flashoverlap": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_distributed_collectives": _torch_collectives(),
        "backends": backends,
    }


def _torch_collectives() -> dict[str, str]:
    """torch.distributed's default collective library per device type. Only gloo ships inside
    torch with no version of its own; the vendors' libraries report theirs through their
    backend's versions()."""
    if not dist.is_available():
        return {}
    out = {}
    for device_type, library in dist.Backend.default_device_backend_map.items():
        out[device_type] = (f"{library} (built into torch {torch.__version__})"
                            if library == "gloo" and dist.is_gloo_available() else library)
    return out


def _guarded(fn):
    """A backend's own report must not take the whole report down."""
    try:
        return fn()
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


def _devices(b: dict) -> str:
    if b["device_type"] in (None, "cpu"):
        return "host"  # ranks share the host: as many as asked for
    return str(b.get("device_count", "-"))


def render(report: dict) -> str:
    lines = [f"flashoverlap {report['flashoverlap']} · torch {report['torch']} · "
             f"python {report['python']} · {report['platform']}"]
    collectives = ", ".join(f"{d}={c}" for d, c in report["torch_distributed_collectives"].items())
    lines.append(f"torch.distributed collective per device type: {collectives or 'not available'}")
    lines.append("")
    rows = [("backend", "device", "available", "devices", "reason")]
    for b in report["backends"]:
        rows.append((b["name"], b["device_type"] or "any", "yes" if b["available"] else "no",
                     _devices(b) if b["available"] else "-", b["reason"] or "-"))
    lines += format_table(rows)
    for b in report["backends"]:
        versions = b.get("versions")
        if versions:
            text = (", ".join(f"{k} {v}" for k, v in versions.items())
                    if isinstance(versions, dict) else versions)
            lines.append(f"{b['name']} versions: {text}")
    return "\n".join(lines)


def git_commit() -> str | None:
    """$FO_COMMIT when set (a copy without .git), else the checkout's commit (``+dirty`` with
    uncommitted changes to tracked files), when run from one."""
    if os.environ.get("FO_COMMIT"):
        return os.environ["FO_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                                capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"], check=True, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
