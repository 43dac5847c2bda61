"""A rank's output on a disk that refuses it (``trainguard.trainer.zygote.text_stream``): a full
log disk must not end training through an OSError from ``print``. Against a real 1 MiB tmpfs that
the test fills; the whole job on such a disk is in test_run_command.py."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers.disk import fill
from trainguard.trainer.zygote import text_stream


def test_output_the_disk_refuses_is_dropped_counted_and_told_once_there_is_room(tiny_tmpfs: Path) -> None:
    log = tiny_tmpfs / "rank0.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
    try:
        filler = fill(tiny_tmpfs)
        out = text_stream(fd)
        for i in range(200):
            print(f"step {i} loss 0.5", file=out)  # raised OSError: No space left on device before
        out.flush()
        raw = out.buffer.raw  # type: ignore[attr-defined]
        lost = sum(len(f"step {i} loss 0.5\n") for i in range(200))
        assert raw.dropped == lost and "No space left" in raw.why, (raw.dropped, raw.why)
        filler.unlink()
        print("step 200 loss 0.4", file=out)
        assert log.read_text() == f"[trainguard: {lost} bytes of output dropped: No space left on device]\nstep 200 loss 0.4\n"
        assert raw.dropped == 0  # told once
    finally:
        os.close(fd)
