"""Saves of one rank's training state through ``torch.distributed.checkpoint`` (DCP) into the
agent's memory tier. What DCP saves of a state, and loads from what the agent picked, are in
``trainguard.checkpoint.dcpstate``.

Saving: the memory tier hands out a staging directory (in the files of a pruned checkpoint, so
the tmpfs pages are already there: writing into fresh pages runs ~7x slower), every rank writes
its DCP shard there, each rank its RNG state, and the committer (rank 0, or each node's local rank
0 when the job spans nodes) writes ``meta.json`` and commits with a checksummed manifest. The
agent copies it to the disk, object and peer tiers in the background. A save that fails on any
rank (a full tmpfs, an I/O error) fails on every rank together (DCP gathers the errors); it is
dropped, reported once on stderr, and training goes on.

When the ranks are data-parallel replicas (or there is one rank), rank 0 writes the one copy alone,
and not in the step: the state is copied into the buffer of its background writer process
(``trainguard.checkpoint.savewriter``), which writes the DCP files, ``meta.json`` and the commit while training
goes on (the step waited ~110 ms for that write in the recovery bench, ~350 ms for a state of 1,800
DCP items). A failure there is rank 0's to report, at its next checkpoint call or ``wait``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from trainguard.agent.checkpoint.errors import CheckpointError
from trainguard.agent.checkpoint.memory import MemoryTier
from trainguard.agent.checkpoint.tier import step_dirname
from trainguard.agent.wire import CKPT_FAILED_ELSEWHERE, part_key
from trainguard.checkpoint.dcpreplay import ReplaySaver
from trainguard.checkpoint.dcpstate import (
    _OPTIM_OPTS,
    ObjectsFastPlanner,
    _dcp_state,
    _layout_hash,
    _resolved,
    _save_alone_dcp,
    _write_meta,
    _writer,
)
from trainguard.checkpoint.rng import pack, rng_bytes, unpack, write_rng_file
from trainguard.checkpoint.savewriter import SaveJob, SaveResult, SaveWriter, SaveWriterError, WriteFailed
from trainguard.checkpoint.statedict import LearnedStateDicts
from trainguard.run.environment import RunEnvironment

SAVE_WAIT_S = 120.0
"""The longest a save waits for the previous one still being written in the background."""
WRITER_STARTS = 3
"""Background writer processes started at most (one that died is replaced): then saves are written
in the training process."""


@dataclass
class SaveStats:
    saves: int = 0
    failures: int = 0
    last_step: int = -1
    last_stall_s: float = 0.0
    """How long the last save blocked the step."""
    last_write_s: float = 0.0
    """How long the background writer took for the last save it wrote."""
    last_error: str = ""
    agreed_later: int = 0
    """Saves whose all-gather ran while training went on (``TierWriter._agree_later``)."""


def _describe(exc: BaseException) -> str:
    """One line for a failed save: the first rank's root cause, not DCP's whole traceback."""
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            # (exception, traceback) from a save without dist, the exception from a collective one
            cause: Any = failure[0] if isinstance(failure, tuple) and failure else failure
            return f"{type(cause).__name__}: {str(cause)[:300]}"
    return f"{type(exc).__name__}: {str(exc)[:300]}"


class TierWriter:
    """Saves of one rank into the agent's memory tier (see the module docstring). ``background``:
    a checkpoint one rank writes alone goes through a ``SaveWriter`` process."""

    def __init__(self, env: RunEnvironment, *, background: bool = True) -> None:
        self.env = env
        self.stats = SaveStats()
        self._tier: MemoryTier | None = None
        self.background = background
        self._saver: SaveWriter | None = None
        self._writer_starts = 0
        self.failed_in_background: list[tuple[int, str]] = []
        self._notes: set[str] = set()
        self._replay = ReplaySaver()  # the background writer's copy keeps its template from save to save
        self._learned = LearnedStateDicts(_OPTIM_OPTS)
        self._agreed_layout: int | None = None
        """The layout hash every replica held at the last save they agreed on (the same on every
        rank: read from the same all-gather), or None: the next save agrees before it writes."""
        self._pending: _Agreement | None = None

    @property
    def tier_job(self) -> str:
        return part_key(self.env.job, self.env.part) if self.env.part else self.env.job

    def _committer(self) -> bool:
        return (self.env.local_rank if self.env.part else self.env.rank) == 0

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _stage_here(self, label: int) -> tuple[str | None, str | None]:
        """(staging directory or None, error or None) on the committing rank; (None, None) elsewhere."""
        if not self._committer():
            return None, None
        try:
            if self._tier is None:
                self._tier = MemoryTier(self.env.memory_root)
            path = self._tier.stage(self.tier_job, label)
            if len(str(path).encode()) > _ROW_TEXT:  # not expected (a memory root of ~4 KB)
                self._tier.abort(self.tier_job, label)
                return None, "the staging path is too long to share"
            os.makedirs(path / "rng", exist_ok=True)
            return str(path), None
        except (OSError, CheckpointError) as exc:
            return None, f"{type(exc).__name__}: {exc}"

    def _staging_path(self, label: int) -> tuple[str | None, str | None]:
        """(staging directory or None, error or None), agreed by every rank."""
        staged, error = self._stage_here(label)
        if not self._distributed():
            return staged, error
        rank = dist.get_rank()
        if self.env.part:
            paths: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(paths, (staged, error))
            return tuple(paths[rank - self.env.local_rank])  # type: ignore[return-value]
        box: list[Any] = [(staged, error)]
        dist.broadcast_object_list(box, src=0)
        return tuple(box[0])  # type: ignore[return-value]

    def _stage_among_replicas(self, label: int, layout: int) -> tuple[str | None, str | None, bool, list[bytes]]:
        """(staging directory or None, error or None, whether every rank's layout hash is
        ``layout``, every rank's RNG states), agreed in one all-gather of a fixed-size row per
        rank: its layout hash and RNG states, and on rank 0 the staging path or the error (a
        broadcast of the path -- two collectives and a pickle -- and an all-reduce of the hashes
        were ~2 ms of a ~6 ms save on two loaded cores; each rank writing its own RNG file and an
        all-reduce to agree they all could, ~0.8 ms more)."""
        staged, error = self._stage_here(label)
        row = _replica_row(staged, error, layout, later=False)
        rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, row)
        agreed = _read_rows(rows)
        self._agreed_layout = agreed.layout
        if agreed.layout is None and agreed.any_later:
            # A replica whose layout was the agreed one did not wait for this all-gather
            # (``_agree_later``): it meets no collective save now, so this one is given up. Every
            # rank read the same rows, so the next save agrees first everywhere.
            error = "the replicas' state layouts no longer agree"
            if staged is not None:
                self._abort(label, staged)
            return None, error, False, agreed.rngs
        alone = agreed.layout is not None and agreed.layout == layout
        return (agreed.told, None, alone, agreed.rngs) if agreed.staged else (None, agreed.told, alone, agreed.rngs)

    def _agree_later(self, label: int, layout: int, tree: Mapping[str, Any], world: int,
                     meta: Mapping[str, Any]) -> str | None | bool:
        """A save of replicas whose layout is the one they last agreed on: rank 0 copies the
        state into its background writer's buffer, every rank starts the all-gather of its row
        and training goes on; rank 0 hands the save to its writer once the rows are in
        (``settle``: at the next checkpoint call, ``wait``, ``close`` or the run's exit). Waiting
        for that all-gather -- for the slowest rank and for gloo's round trips on busy cores -- was
        1-14 ms of a ~14 ms save on the recovery bench's 4 ranks on 2 cores (BENCHMARKS.md). The
        checkpoint's path (committed shortly, like any background save), None when rank 0 could
        not stage it (reported), or False when rank 0 has no background writer to hand it to: then
        it agrees and writes in the step, as a first save does (the others' all-gather meets its
        own, and with every layout equal no other collective follows)."""
        rank = dist.get_rank()
        staged, error, job = None, None, None
        if rank == 0:
            staged, error = self._stage_here(label)
            if staged is not None:
                # Staged before the all-gather starts: the writer's first start forks this process.
                job = self._stage_background(label, staged, tree, world, meta, [])
                if job is None:
                    self._abort(label, staged)
                    return False
        row = _replica_row(staged, error, layout, later=True)
        rows = [torch.empty_like(row) for _ in range(world)]
        work = dist.all_gather(rows, row, async_op=True)
        self._pending = _Agreement(label, staged, row, rows, work, job)
        self.stats.agreed_later += 1
        if rank == 0 and staged is None:
            return self._failed(label, error or "no staging directory")
        if staged is not None:
            return os.path.join(os.path.dirname(staged), step_dirname(label))
        return str(MemoryTier(self.env.memory_root).step_path(self.tier_job, label))

    def settle(self, block: bool) -> None:
        """Finish the save whose all-gather ``_agree_later`` started, once its rows are in (at
        once with ``block``): rank 0 hands it to its writer with every rank's RNG states, or drops
        it when the replicas' layouts no longer agree (the next save then agrees first, on every
        rank: they all read the same rows)."""
        pending = self._pending
        if pending is None or not (block or pending.work.is_completed()):
            return
        self._pending = None
        try:
            pending.work.wait()
        except Exception as exc:  # noqa: BLE001 - a rank gone mid-save costs the save, never training
            self._agreed_layout = None
            self._drop_pending(pending, f"the ranks' agreement failed: {_describe(exc)}")
            return
        agreed = _read_rows(pending.rows)
        self._agreed_layout = agreed.layout
        if agreed.layout is None:
            self._drop_pending(pending, "the replicas' state layouts no longer agree")
            return
        if pending.job is None:  # not rank 0, or its staging failed (reported)
            if dist.get_rank() != 0:
                self._saved(pending.label)
            return
        pending.job.context["rngs"] = agreed.rngs
        if not self._submit(pending.job):
            assert pending.staged is not None
            self._abort(pending.label, pending.staged)
            self._report_later(pending.label, "the background writer could not take the save")

    def _drop_pending(self, pending: _Agreement, error: str) -> None:
        if pending.staged is not None:
            self._abort(pending.label, pending.staged)
        if pending.job is not None:  # rank 0's to report (a staging that failed was reported)
            self._report_later(pending.label, error)

    def _report_later(self, label: int, error: str) -> None:
        """A failure found after ``save`` returned: counted, printed, and told at the next ``poll``."""
        self._failed(label, error)
        self.failed_in_background.append((label, error))

    def save(self, label: int, state: Mapping[str, Any], meta: Mapping[str, Any], *,
             agree_later: bool = False) -> str | None:
        """Collective save of ``state`` as checkpoint ``label`` (steps done); the checkpoint's path
        (committed now, or by the background writer shortly), or None when the save failed
        (already reported). A background write that fails later is reported by ``poll``.
        ``agree_later``: a save of replicas may leave their agreement to the background
        (``_agree_later``); for a caller whose per-step snapshots cover a crash before it is
        handed over."""
        t0 = time.perf_counter()
        self.settle(block=True)
        self._collect(self._saver.wait(SAVE_WAIT_S) if self._saver is not None and self._saver.in_flight else None)
        rank = dist.get_rank() if self._distributed() else 0
        world = dist.get_world_size() if self._distributed() else 1
        replicas_possible = world > 1 and not self.env.part  # else there is no second copy to leave out
        early: Mapping[str, Any] | None = None
        if replicas_possible:
            try:
                early = _resolved(_dcp_state(state), self._learned)
                layout = _layout_hash(early)
            except Exception:  # noqa: BLE001 - DCP's collective save below meets the others and reports it
                early, layout = None, -1 - rank
            # Every rank holds the same keys, shapes and plain tensors (data-parallel replicas):
            # DCP would keep one copy of each anyway, so rank 0 writes it alone, without DCP's
            # dozen collectives (~50 ms on two loaded cores, for any state size).
            if agree_later and early is not None and layout == self._agreed_layout and self.background:
                later = self._agree_later(label, layout, early, world, meta)
                if later is not False:
                    self.stats.last_stall_s = time.perf_counter() - t0
                    return later  # type: ignore[return-value]
            path, error, alone, rngs = self._stage_among_replicas(label, layout)
        else:
            path, error = self._staging_path(label)
            alone = world == 1
            rngs = [pack(rng_bytes())]
        if path is None:
            return self._failed(label, error or "no staging directory")
        final = os.path.join(os.path.dirname(path), step_dirname(label))
        if alone:
            failed = self._save_alone(label, path, state, early, world, meta, rngs) if rank == 0 else None
            if failed is not None:
                return self._failed(label, failed)
            if rank != 0:
                self._saved(label)
            self.stats.last_stall_s = time.perf_counter() - t0
            return final
        try:
            resolved = _dcp_state(state)
            dcp.save(resolved, storage_writer=_writer(path), planner=ObjectsFastPlanner())
            write_rng_file(os.path.join(path, "rng", f"rank{rank}.pt"))
            ok = self._all_ok(True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a checkpoint that cannot be written must not stop training
            # DCP gathers every rank's failure into a CheckpointException, which is a BaseException.
            error = _describe(exc)
            self._all_ok(False)
            ok = False
        if not ok:
            self._abort(label, path)
            return self._failed(label, error or CKPT_FAILED_ELSEWHERE)
        try:
            if rank == 0:
                _write_meta(path, label, world, meta)
            if self._committer():
                assert self._tier is not None
                self._tier.commit(self.tier_job, label, self._commit_extra(world), staged=path, prune=False)
            committed = self._all_ok(True)
        except (OSError, CheckpointError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            committed = self._all_ok(False)
        if not committed:
            self._abort(label, path)
            return self._failed(label, error or "the commit failed on another rank")
        self._saved(label)
        self.stats.last_stall_s = time.perf_counter() - t0
        return final

    # -- writing alone, in the background or here ------------------------------------------------

    def _commit_extra(self, world: int, *, whole: bool = False) -> dict[str, Any]:
        """What the manifest records beside the files; ``whole``: one rank wrote every rank's state
        (a node that holds it can send it to other nodes' ranks)."""
        extra: dict[str, Any] = {"world_size": world, "whole": whole or world == 1}
        if self.env.part:
            extra |= {"job": self.env.job, "part": self.env.part, "parts": list(self.env.parts)}
        return extra

    def _save_alone(self, label: int, path: str, state: Mapping[str, Any], early: Mapping[str, Any] | None,
                    world: int, meta: Mapping[str, Any], rngs: list[bytes]) -> str | None:
        """Rank 0's part of a checkpoint it writes alone (one rank, or data-parallel replicas): the
        state handed to the background writer, or written here; the other ranks are done once
        their RNG states came in the all-gather (a failure is rank 0's to report). The error, or
        None."""
        try:
            tree = early if early is not None else _resolved(_dcp_state(state), self._learned)
            job = self._stage_background(label, path, tree, world, meta, rngs)
            if self._submit(job):
                return None
            self._write_alone(label, path, tree, world, meta, rngs)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a checkpoint that cannot be written must not stop training
            self._abort(label, path)
            return _describe(exc)
        self._saved(label)
        return None

    def _write_alone(self, label: int, path: str, tree: Mapping[str, Any], world: int,
                     meta: Mapping[str, Any], rngs: list[bytes]) -> None:
        """DCP files, every rank's RNG file, meta.json and the commit of a checkpoint one rank
        writes alone (here, or in the background writer: no collective)."""
        self._replay.save(path, tree, _save_alone_dcp)
        for rank, blob in enumerate(rngs):
            if blob:
                write_rng_file(os.path.join(path, "rng", f"rank{rank}.pt"), unpack(blob))
        _write_meta(path, label, world, meta)
        assert self._tier is not None
        self._tier.commit(self.tier_job, label, self._commit_extra(world, whole=True), staged=path, prune=False)

    def _write_job(self, job: SaveJob, tree: Any) -> None:
        """What the background writer runs for each save (in its own process)."""
        try:
            self._write_alone(job.label, job.staging, tree, job.context["world"], job.context["meta"],
                              job.context["rngs"])
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - told back to the rank in one line
            raise WriteFailed(_describe(exc)) from None

    def _stage_background(self, label: int, path: str, tree: Mapping[str, Any], world: int,
                          meta: Mapping[str, Any], rngs: list[bytes]) -> SaveJob | None:
        """The state copied into the background writer's buffer; None: write it here instead."""
        if not self.background:
            return None
        if self._saver is not None and not self._saver.alive:
            self._saver.close()
            self._saver = None
        try:
            if self._saver is None:
                if self._writer_starts >= WRITER_STARTS:
                    return None
                self._writer_starts += 1
                self._saver = SaveWriter(self._write_job)
            return self._saver.stage(label, path, dict(tree), {"world": world, "meta": dict(meta), "rngs": rngs})
        except (SaveWriterError, OSError) as exc:
            self._note(f"writing the checkpoint of step {label} in the training process: {exc}")
            return None

    def _submit(self, job: SaveJob | None) -> bool:
        if job is None or self._saver is None:
            return False
        try:
            self._saver.submit(job)
        except SaveWriterError as exc:
            self._note(f"writing the checkpoint of step {job.label} in the training process: {exc}")
            return False
        assert self._tier is not None
        self._tier.hand_over(self.tier_job, job.label)
        return True

    def _collect(self, result: SaveResult | None) -> None:
        if result is None:
            return
        self.stats.last_write_s = result.seconds
        if result.ok:
            self._saved(result.label)
        else:
            self._report_later(result.label, result.error)

    def _saved(self, label: int) -> None:
        self.stats.saves += 1
        self.stats.last_step = max(self.stats.last_step, label)

    def poll(self) -> list[tuple[int, str]]:
        """(step, error) of background saves that failed since the last call (never waits)."""
        self.settle(block=False)
        if self._saver is not None and self._saver.in_flight is not None:
            self._collect(self._saver.poll())
        failed, self.failed_in_background = self.failed_in_background, []
        return failed

    def wait(self, timeout: float = SAVE_WAIT_S) -> bool:
        """Wait for the background save in flight; False when it is still being written after
        ``timeout`` (its outcome, like every failure, comes from ``poll``)."""
        self.settle(block=True)
        if self._saver is not None and self._saver.in_flight is not None:
            self._collect(self._saver.wait(timeout))
        return self._saver is None or self._saver.in_flight is None

    def close(self) -> None:
        """Finish the background save in flight and end the writer process."""
        self.settle(block=True)
        if self._saver is not None:
            self._collect(self._saver.close(SAVE_WAIT_S))
            self._saver = None
        self._learned.forget()

    def _note(self, text: str) -> None:
        if text not in self._notes:
            self._notes.add(text)
            print(f"trainguard: {text}", file=sys.stderr, flush=True)

    def _all_ok(self, ok: bool) -> bool:
        if not self._distributed():
            return ok
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        dist.all_reduce(flag)
        return int(flag.item()) == 0

    def _abort(self, label: int, path: str) -> None:
        if self._committer() and self._tier is not None:
            self._tier.abort(self.tier_job, label)
            shutil.rmtree(path, ignore_errors=True)

    def _failed(self, label: int, error: str) -> str | None:
        self.stats.failures += 1
        self.stats.last_error = error
        if self.env.rank == 0:
            print(f"trainguard: checkpoint of step {label} skipped: {error}", file=sys.stderr, flush=True)
        return None


_ROW_HEAD = 11  # layout hash (8 bytes), flags (1: _STAGED, _LATER), text length (2)
_STAGED, _LATER = 1, 2
_ROW_TEXT = 4085
_ROW_RNG = 8192  # the rank's RNG states: their length (4 bytes) and ``rng.pack`` (CPU ~5 KB, CUDA 16 bytes)


@dataclass
class _Agreement:
    """A replicas' save whose all-gather is still in flight (``TierWriter._agree_later``): the
    rows stay referenced until it is done."""

    label: int
    staged: str | None
    row: torch.Tensor
    rows: list[torch.Tensor]
    work: Any
    job: SaveJob | None


@dataclass
class _Rows:
    """What one all-gather of the replicas' rows says."""

    told: str
    """Rank 0's staging path, or its error."""
    staged: bool
    layout: int | None
    """The layout every rank holds, None when they differ or one is its own (sharded)."""
    any_later: bool
    """Whether a rank went on training without waiting for these rows (``_agree_later``)."""
    rngs: list[bytes]


def _replica_row(staged: str | None, error: str | None, layout: int, *, later: bool) -> torch.Tensor:
    """This rank's row: its layout hash, whether rank 0 staged (with the path, or its error),
    whether this rank goes on without waiting for the rows (``later``) and its RNG states."""
    text = (staged or error or "").encode()[:_ROW_TEXT]  # only rank 0's is read (a path fits: ``_stage_here``)
    flags = (_STAGED if staged is not None else 0) | (_LATER if later else 0)
    head = layout.to_bytes(8, "little", signed=True) + bytes([flags])
    head += len(text).to_bytes(2, "little")
    rng = pack(rng_bytes())
    rng = rng if len(rng) <= _ROW_RNG - 4 else b""  # not expected: the RNG file is then left out
    row = torch.zeros(_ROW_HEAD + _ROW_TEXT + _ROW_RNG, dtype=torch.uint8)
    row[:_ROW_HEAD + len(text)] = torch.frombuffer(bytearray(head + text), dtype=torch.uint8)
    at = _ROW_HEAD + _ROW_TEXT
    row[at:at + 4 + len(rng)] = torch.frombuffer(bytearray(len(rng).to_bytes(4, "little") + rng), dtype=torch.uint8)
    return row


def _read_rows(rows: list[torch.Tensor]) -> _Rows:
    raw = [r.numpy().tobytes() for r in rows]
    at = _ROW_HEAD + _ROW_TEXT
    layouts = [int.from_bytes(r[:8], "little", signed=True) for r in raw]
    rngs = [r[at + 4:at + 4 + int.from_bytes(r[at:at + 4], "little")] for r in raw]
    first = raw[0]
    told = first[_ROW_HEAD:_ROW_HEAD + int.from_bytes(first[9:11], "little")].decode(errors="replace")
    common = layouts[0] if layouts[0] >= 0 and all(v == layouts[0] for v in layouts) else None
    return _Rows(told, bool(first[8] & _STAGED), common, any(r[8] & _LATER for r in raw), rngs)
