"""Saving a report under the run directory (stacks/<timestamp>.txt, .json) and its event."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from dataclasses import asdict

from ranktop.core.events import EventLog
from ranktop.core.layout import STACKS, Dir, RunDir
from ranktop.core.stacks.model import StackReport
from ranktop.core.stacks.render import format_report


def save_report(report: StackReport, run_dir: RunDir, events: EventLog | None = None,
                source: str = "api") -> StackReport:
    """Write <run dir>/stacks/<timestamp>.{txt,json} and a `stacks_dumped` event; best effort."""
    stamp = datetime.datetime.fromtimestamp(report.taken_at).strftime("%Y%m%d-%H%M%S-%f")[:-3]
    folder = os.path.join(run_dir.path, STACKS)
    txt, js = os.path.join(folder, stamp + ".txt"), os.path.join(folder, stamp + ".json")
    saved = dataclasses.replace(report, saved_txt=txt, saved_json=js)
    if run_dir.fd < 0:  # the run has ended and let its directory go: the dump is all gone ranks
        return dataclasses.replace(report, save_error="not saved: the run has ended")
    try:
        held = run_dir.stacks()
        try:
            _write_new(held, stamp + ".json", json.dumps(report_to_dict(saved), indent=1))
            _write_new(held, stamp + ".txt", format_report(saved, threads=True) + "\n")
        finally:
            held.close()
    except OSError as exc:  # a read-only, full or deleted log dir must not cost the user the view itself
        return dataclasses.replace(report, save_error=f"not saved in {folder}: {exc.strerror or exc}")
    fields = {"file": txt, "ranks": [s.rank for s in report.ranks], "groups": len(report.groups),
              "odd_ranks": report.odd_ranks, "problems": {s.rank: s.status.value for s in report.problems},
              "elapsed_s": round(report.elapsed_s, 4), "source": source}
    if events is not None:
        events.write("stacks_dumped", **fields)
    elif (fd := run_dir.open_events(create=False)) is not None:
        theirs = EventLog(fd)
        try:
            theirs.write("stacks_dumped", **fields)
        finally:
            theirs.close()
    return saved


def _write_new(folder: Dir, name: str, text: str) -> None:
    with os.fdopen(folder.open_new(name), "w") as f:
        f.write(text)


def report_to_dict(report: StackReport) -> dict:
    data = asdict(report)
    data["odd_ranks"] = report.odd_ranks
    return data
