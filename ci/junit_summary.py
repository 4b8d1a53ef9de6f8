#!/usr/bin/env python3
"""Summarise pytest JUnit XML files of a device run into one result JSON.

    python ci/junit_summary.py NAME OUT.json --world-sizes 2,3,4 XML... [--extra JSON...]

Writes ``{"benchmark": NAME, device, date, commit, command, "summary": {world_sizes, passed,
failed, skipped, hangs, errors}, "suites": {xml name: counts}, "failures": [...], "skips":
{reason: count}, "extra": {file name: its JSON}}``. A hang is a test that failed through a
timeout (pytest-timeout's "Timeout", a rank pool's RankTimeout). Exit status 1 when anything
failed, hung or a file is missing.
"""
from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HANG_MARKERS = ("Timeout", "RankTimeout", "timed out")


def device_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception as e:  # noqa: BLE001 - a summary still gets written
        return f"unknown ({e})"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def read(path: Path) -> dict:
    counts = collections.Counter()
    failures, skips = [], collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if failed is not None:
            text = (failed.get("message") or "") + (failed.text or "")
            hang = any(m in text for m in HANG_MARKERS)
            counts["hangs" if hang else "failed"] += 1
            failures.append({"test": name, "hang": hang, "message": text[:1500]})
        elif skipped is not None:
            counts["skipped"] += 1
            skips[(skipped.get("message") or "")[:300]] += 1
        else:
            counts["passed"] += 1
    return {"counts": counts, "failures": failures, "skips": skips}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name")
    p.add_argument("out")
    p.add_argument("--world-sizes", required=True)
    p.add_argument("xml", nargs="+")
    p.add_argument("--extra", nargs="*", default=[], help="JSON files to embed")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    total, suites, failures, skips, missing = collections.Counter(), {}, [], collections.Counter(), []
    for x in args.xml:
        path = Path(x)
        if not path.is_file():
            missing.append(x)
            continue
        got = read(path)
        total.update(got["counts"])
        suites[path.name] = dict(got["counts"])
        failures += got["failures"]
        skips.update(got["skips"])
    extra = {}
    for e in args.extra:
        try:
            extra[Path(e).name] = json.loads(Path(e).read_text())
        except (OSError, ValueError) as err:
            missing.append(f"{e} ({err})")
    summary = {"world_sizes": [int(w) for w in args.world_sizes.split(",")],
               **{k: total.get(k, 0) for k in ("passed", "failed", "skipped", "hangs")},
               "missing": missing}
    doc = {"benchmark": args.name, "device": device_name(),
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "note": args.note, "summary": summary, "suites": suites, "failures": failures,
           "skips": dict(skips.most_common()), "extra": extra}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary))
    return 1 if (summary["failed"] or summary["hangs"] or missing) else 0


if __name__ == "__main__":
    sys.exit(main())
