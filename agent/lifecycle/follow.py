"""Following a submitted job from the command line: a live progress line, or the ranks' per-step
JSON (``--json``), then a summary. Reads only the agent API and rank 0's log file."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

FINISHED = {"succeeded", "failed", "stopped"}


def _rank_line(job: dict[str, Any]) -> str:
    parts = []
    for r in job.get("ranks", []):
        tel = r.get("telemetry") or {}
        if tel:
            parts.append(f"r{r['rank']}:{tel.get('step', '-')}@{tel.get('step_s', 0):.2f}s")
    return " ".join(parts)


def _tail_json(path: str, offset: int, out: TextIO) -> int:
    """Print complete JSON lines appended to ``path`` since ``offset``; returns the new offset. A
    file shorter than ``offset`` was rotated (``agent.lifecycle.ranklogs``): read from its start."""
    try:
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < offset:
                offset = 0
            fh.seek(offset)
            data = fh.read()
    except OSError:
        return offset
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        text = line.decode(errors="replace").strip()
        if text.startswith("{"):
            try:
                json.loads(text)
            except ValueError:
                continue
            out.write(text + "\n")
    out.flush()
    return offset + end


def follow_job(client: Any, job: str, *, json_out: bool = False, out: TextIO = sys.stdout, poll_s: float = 0.5) -> int:
    offsets: dict[str, int] = {}
    seen_seq = 0
    last: dict[str, Any] = {}
    last_line_at = 0.0
    while True:
        try:
            last = client.job(job)
        except Exception as exc:  # noqa: BLE001 - the agent went away: say so, once
            print(f"\ntrainguard: lost the agent while following {job}: {exc}", file=sys.stderr)
            return 1
        if json_out:
            ranks = last.get("ranks", [])
            if ranks:
                log = ranks[0]["log"]
                offsets[log] = _tail_json(log, offsets.get(log, 0), out)
        else:
            st = client.status()
            jobs = {j["job"]: j for j in st["jobs"]}
            evs = client.events(since=seen_seq, limit=200)
            for e in evs["events"]:
                if e.get("job") == job and e["severity"] in ("warning", "error", "critical"):
                    prefix = "\r\033[K" if out.isatty() else ""
                    print(f"{prefix}  ! {e['kind']}: {e['message']}", file=out)
            seen_seq = evs["next"]
            line = f"{job} {last['state']} step {last.get('progress_step', '-')} restarts {last.get('restarts', 0)} {_rank_line(jobs.get(job, {}))}"
            if out.isatty():
                print(f"\r\033[K{line[:160]}", end="", file=out, flush=True)
            elif time.monotonic() - last_line_at >= 5 or last.get("state") in FINISHED:
                print(line, file=out, flush=True)
                last_line_at = time.monotonic()
        if last.get("state") in FINISHED:
            break
        time.sleep(poll_s)
    if not json_out:
        print(file=out)
        print(f"job {job}: {last['state']} at step {last.get('progress_step')} after {last.get('restarts', 0)} restart(s)", file=out)
    return 0 if last.get("state") == "succeeded" else 1
