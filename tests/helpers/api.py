"""A stand-in for the daemon behind a real ApiServer, the tokens it accepts, and a token file."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainguard.agent.api.handler import ApiError, Blob, BlobReader

ADMIN = "a" * 40
READER = "r" * 40


class FakeDaemon:
    """Just enough of the daemon: records calls, stores blobs in files, can block and fail."""

    def __init__(self, blob_dir: Path) -> None:
        self.blob_dir = blob_dir
        self.release = threading.Event()
        self.entered_slow = threading.Event()
        self.left_slow = threading.Event()
        self.plan: dict[str, Any] = {"version": 1, "lr_scale": 1.0}
        self.detection: dict[str, Any] = {"straggler_threshold": 0.8}
        self.calls: list[tuple[str, Any]] = []
        self.aborted_uploads = 0

    def health(self) -> dict[str, Any]:
        return {"node": "n1", "version": "test"}

    def status(self) -> dict[str, Any]:
        return {"node": "n1", "collectors": {"host": {"up": True, "reason": ""}}, "leader": "n1",
                "jobs": {"j1": {"ranks": {"0": {"straggler_score": float("nan"), "step_s": [0.5, float("inf")]}}}}}

    def events(self, since: int, limit: int, kind: str | None) -> dict[str, Any]:
        self.calls.append(("events", (since, limit, kind)))
        return {"events": [{"seq": since + 1, "kind": kind or "x"}], "next": since + 1}

    def list_jobs(self) -> list[Any]:
        return [{"job": "j1", "state": "running"}]

    def submit_job(self, spec: dict[str, Any]) -> dict[str, Any]:
        if "command" not in spec:
            raise ApiError(400, "job spec needs 'command'")
        self.calls.append(("submit", spec))
        return {"job": "j2"}

    def get_job(self, job: str) -> dict[str, Any]:
        if job == "slow":
            self.entered_slow.set()
            self.release.wait(10)
            self.left_slow.set()
            return {"job": job}
        if job == "boom":
            raise RuntimeError("secret internal detail")
        if job != "j1":
            raise ApiError(404, f"no job {job}")
        return {"job": job, "state": "running", "nproc": 2}

    def job_output(self, job: str, rank: int, offset: int, limit: int) -> dict[str, Any]:
        self.calls.append(("output", (job, rank, offset, limit)))
        return {"rank": rank, "offset": offset, "next": offset + 4, "size": offset + 4, "text": f"r{rank}\n\n"}

    def stop_job(self, job: str, options: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("stop", (job, options)))
        return {"job": job, "state": "stopping"}

    def get_plan(self, job: str) -> dict[str, Any]:
        return self.plan

    def update_plan(self, job: str, fields: dict[str, Any]) -> dict[str, Any]:
        self.plan = {**self.plan, **fields, "version": self.plan["version"] + 1}
        return self.plan

    def list_checkpoints(self, job: str | None) -> list[Any]:
        return [{"job": job, "step": 100, "tier": "memory"}]

    def checkpoint_now(self, job: str, options: dict[str, Any]) -> dict[str, Any]:
        return {"job": job, "requested": True}

    def drain(self, job: str, target: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("drain", (job, target)))
        return {"job": job, **target}

    def get_detection_config(self) -> dict[str, Any]:
        return self.detection

    def update_detection_config(self, fields: dict[str, Any]) -> dict[str, Any]:
        self.detection.update(fields)
        return self.detection

    def put_blob(self, namespace: str, path: str, body: BlobReader) -> dict[str, Any]:
        dst = self.blob_dir / namespace / path
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_suffix(".part")
        try:
            with open(tmp, "wb") as f:
                while chunk := body.read(256 * 1024):
                    f.write(chunk)
        except ConnectionError:
            tmp.unlink()
            self.aborted_uploads += 1
            raise
        tmp.replace(dst)
        return {"size": body.size}

    def get_blob(self, namespace: str, path: str) -> Blob:
        src = self.blob_dir / namespace / path
        if not src.is_file():
            raise ApiError(404, f"no blob {namespace}/{path}")

        def chunks() -> Iterator[bytes]:
            with open(src, "rb") as f:
                while chunk := f.read(256 * 1024):
                    yield chunk

        return Blob(src.stat().st_size, chunks())

    def delete_blob(self, namespace: str, path: str) -> dict[str, Any]:
        (self.blob_dir / namespace / path).unlink()
        return {"deleted": path}


def token_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path
