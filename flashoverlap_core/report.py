"""``flashoverlap report``: what this machine can run, and with which versions.

Every backend (name, device type, available or why not, devices), the versions each available
backend reports (collective library, compiler, ...), torch's collective library per device
type, torch and Python. Nothing here creates a device context.
"""
from __future__ import annotations

import argparse
import json
import platform

import torch
import torch.distributed as dist

from . import __version__, registry


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def collect() -> dict:
    """The report as plain data (also recorded with every benchmark result)."""
    backends = []
    for status in registry.backends():
        entry = {"name": status.name, "device_type": status.device_type,
                 "available": status.available, "reason": status.reason}
        if status.available:
            backend = registry.get(status.name)
            entry["device_count"] = _guarded(backend.device_count)
            entry["versions"] = _guarded(backend.versions)
        backends.append(entry)
    collectives = dict(dist.Backend.default_device_backend_map) if dist.is_available() else {}
    return {
        "flashoverlap": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch_distributed_collectives": collectives,
        "backends": backends,
    }


def _guarded(fn):
    """A backend's own report must not take the whole report down."""
    try:
        return fn()
    except Exception as e:
        return f"error: {type(e).__name__}: {e}"


def render(report: dict) -> str:
    lines = [f"flashoverlap {report['flashoverlap']} · torch {report['torch']} · "
             f"python {report['python']} · {report['platform']}"]
    collectives = ", ".join(f"{d}={c}" for d, c in report["torch_distributed_collectives"].items())
    lines.append(f"torch.distributed collective per device type: {collectives or 'not available'}")
    lines.append("")
    rows = [("backend", "device", "available", "devices", "reason")]
    for b in report["backends"]:
        rows.append((b["name"], b["device_type"] or ("any" if b["available"] else "-"), "yes" if b["available"] else "no",
                     str(b.get("device_count", "-")), b["reason"] or "-"))
    lines += format_table(rows)
    for b in report["backends"]:
        versions = b.get("versions")
        if versions:
            text = (", ".join(f"{k} {v}" for k, v in versions.items())
                    if isinstance(versions, dict) else versions)
            lines.append(f"{b['name']} versions: {text}")
    return "\n".join(lines)


def format_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns, header underlined; the last column is not padded."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]

    def line(row):
        return "  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]

    return [line(rows[0]), line(tuple("-" * len(c) for c in rows[0]))] + [line(r) for r in rows[1:]]


def run(args: argparse.Namespace) -> int:
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
