"""Per-step snapshots of a rank's state into pre-faulted shared memory (``trainguard.checkpoint.snapshot.load``
restores them).

The file format and the agent's side are in ``trainguard.agent.checkpoint.snapshots``. Here a
snapshot is: the state's ``state_dict()``s walked into a list of tensors and a skeleton (the
structure with a placeholder per tensor), the tensors copied into views of a mapped slot file whose
layout is kept while the tensors' shapes stay the same, and the skeleton pickled behind them. CPU
tensors of one dtype lie back to back in the slot and go in with one ``torch.cat(out=)`` per dtype
(``torch._foreach_copy_`` on the CPU copies tensor by tensor: 0.2-0.9 ms for the bench model's 100
tensors, 1.6 MB, against 0.06 ms for one cat); device tensors go with ``_foreach_copy_``. The training thread is blocked for that copy and the walk, nothing
else: no collective, no planning, no file creation after the first snapshot.

With ``overlap`` (what ``Run`` uses where the node has a core for each rank's helper thread:
``overlap_pays``), the tensors that only an optimizer's ``step`` changes (the
parameters of a built-in ``torch.optim`` optimizer in the state, and its state) are copied by a
helper thread while the next step's forward and backward run (CheckFreq's pipelined snapshot): torch
releases the GIL for the copy, and the optimizer's step pre-hook waits for it, so the copy still sees
the state of the step it is labelled with. Everything else (buffers, which a forward may update in
place, other tensors, the skeleton's values) is copied before ``take`` returns (the RNG states are
read then, and their bytes put into the skeleton by the helper), and the slot is marked complete only
once the helper is done. Also waited for: the next snapshot, a
``load_state_dict`` of a module or optimizer in the state, a ``fork`` of the rank, ``wait``,
``close``. Not seen: a script writing parameters in place outside its optimizer between a
checkpoint and the next optimizer step (``wait()`` first). The stall it costs is the time ``take``
blocks plus the time a step waits for the copy (``SnapshotStats.last_stall_s``).

``state`` is what ``Run.checkpoint`` takes. A mapping with a ``snapshot_state()`` method gives the
snapshot that instead: the same state as raw modules and optimizers (the embedded trainer's
checkpoint state is built for DCP resharding, whose ``state_dict`` costs milliseconds).

Data-parallel replicas on one node share out the tensors they hold alike (``share``): each rank's
slot keeps its part of them and says which rank's slot keeps each of the others
(``trainguard.checkpoint.snapshot.replicas``), so the ranks together copy and keep one copy, not one each.
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainguard.agent.checkpoint.snapshots import SLOTS, WRITING, SlotHeader, read_done, slot_path
from trainguard.checkpoint.rng import fill_stand_ins, rng_bytes, rng_states, stand_ins
from trainguard.checkpoint.snapshot.errors import SnapshotError
from trainguard.checkpoint.snapshot.plan import CopyPlan, data_ptrs
from trainguard.checkpoint.snapshot.skeleton import (
    PARTS,
    ReusedPickler,
    read_skeleton,
    signature_of,
    snapshot_view,
)
from trainguard.checkpoint.snapshot.slot import Slot, sum_payload


@dataclass
class SnapshotStats:
    taken: int = 0
    last_step: int = -1
    last_stall_s: float = 0.0
    """What the newest finished snapshot blocked training: ``take`` and a step's wait for its copy."""
    total_stall_s: float = 0.0
    state_bytes: int = 0
    last_cost_s: float = 0.0
    """What the newest finished snapshot cost this rank's CPU: ``take`` and the helper thread's
    copy (on a node whose cores the ranks fill, the helper's copy comes out of training too)."""
    overlapped: int = 0
    """Snapshots whose optimizer-owned tensors the helper thread copied."""
    skipped: int = 0
    """Overlapped snapshots not completed: their copy failed or found the state's tensors changed."""


class _LateCopy:
    """A snapshot's deferred part, run by the helper thread: check that the plan's tensors are
    still the ones it found (identity, data pointers), copy the deferred runs, write the skeleton
    and mark the slot complete. A plan that no longer holds skips the snapshot (the slot keeps
    what it had, or stays incomplete) and makes the next one work its plan out again."""

    def __init__(self, writer: SnapshotWriter, plan: CopyPlan, slot: Slot, flats: list[torch.Tensor],
                 tensors: list[torch.Tensor], dynamic: bytes, step: int, header: SlotHeader | None,
                 rng_states: dict[str, torch.Tensor | None] | None = None) -> None:
        """``header``: what ``take`` wrote into the slot before copying into it there; None: it
        copied nothing into it, the slot still says what it held, and the header is written here."""
        self.writer, self.plan, self.slot, self.flats = writer, plan, slot, flats
        self.tensors, self.dynamic, self.step, self.header = tensors, dynamic, step, header
        self.rng_states = rng_states
        self.done = False
        self.cpu_s = 0.0

    def run(self) -> None:
        c0 = time.thread_time()
        try:
            self._run()
        finally:
            self.cpu_s = time.thread_time() - c0

    def _run(self) -> None:
        writer, slot = self.writer, self.slot
        if not self.plan.holds_memory(writer._flat_ptrs):
            writer._stale = True
            return
        header = self.header
        if header is None:
            header = writer._header(self.step)
            slot.write_header(header)
        slot.copy_in(self.tensors, self.flats, True)
        dynamic = fill_stand_ins(self.dynamic, self.rng_states) if self.rng_states is not None else self.dynamic
        slot.finish(self.plan.static_bytes, dynamic, header)
        writer._last_skeleton = slot.skeleton_bytes
        self.done = True
        writer._sum(slot, header.step)


class _Copier:
    """One helper thread running one job at a time (a snapshot's deferred copy). A queue and a
    lock rather than a condition variable: each hand-off is a snapshot's cost, and
    ``Condition.wait`` makes a lock of its own every time in Python."""

    def __init__(self, name: str = "trainguard-snapshot-copy") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._running = threading.Lock()
        """Held from a job's submission until it is done."""
        self.busy = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._running.acquire()  # the previous job is done (``SnapshotWriter.take`` waited for it)
        self.busy = True
        self._jobs.put(job)

    def wait(self) -> None:
        if self.busy:
            with self._running:
                pass

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - told to the rank at its next snapshot
                self.error = exc
            self.busy = False
            self._running.release()


_WRITERS: weakref.WeakSet[SnapshotWriter] = weakref.WeakSet()
_AT_FORK: list[bool] = []


def _wait_all_before_fork() -> None:
    # A child forked in the middle of a copy would inherit whatever the helper thread held.
    for writer in list(_WRITERS):
        writer.wait_summed()


class SnapshotWriter:
    """One rank's snapshots (see the module docstring). ``share``: the ranks of this job share out
    the tensors they hold alike (data-parallel replicas on one node: ``trainguard.checkpoint.snapshot.replicas``)."""

    def __init__(self, directory: str, rank: int, world_size: int, attempt: int, *, share: bool = False,
                 overlap: bool = False, checksum: bool = True) -> None:
        """``checksum``: record each slot's payload crc32 (a thread of its own sums it after the slot
        is complete, off the training thread and off the copy a step waits for)."""
        self.directory = directory
        self.checksum = checksum
        self._summer: _Copier | None = None
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        self.share = share and world_size > 1
        self.overlap = overlap
        self.stats = SnapshotStats()
        self._copier: _Copier | None = None
        self._pending: tuple[int, float, _LateCopy] | None = None
        """(step, seconds ``take`` blocked, its copy) of the snapshot whose deferred copy is in flight."""
        self._stale = False
        """The helper found the plan's tensors changed: work it out again."""
        self._hooks: list[Any] = []
        self._hooked: tuple[int, ...] = ()
        self._guarded_plan: CopyPlan | None = None
        os.makedirs(directory, exist_ok=True)
        self._slots = [Slot(str(slot_path(directory, rank, s))) for s in SLOTS]
        self._last_skeleton = 0
        self._plan: CopyPlan | None = None
        self._flats: list[torch.Tensor] | None = None
        self._flat_ptrs: list[int] = []
        self._meta_cache: tuple[dict[str, Any], bytes] | None = None
        self._pickler = ReusedPickler()

    def _target(self) -> Slot:
        """The slot not holding the newest complete snapshot."""
        first, second = self._slots
        return second if first.step >= second.step else first

    def take(self, step: int, state: Mapping[str, Any], meta: Mapping[str, Any]) -> float:
        """Snapshot ``state`` as of ``step`` steps done; returns the seconds this call blocked
        (with ``overlap``, a copy may go on after it: ``wait``). Raises SnapshotError (nothing
        newer was recorded, the previous snapshot stays)."""
        self.wait()
        if self._copier is not None and self._copier.error is not None:
            error, self._copier.error = self._copier.error, None
            raise SnapshotError(f"the copy of the previous snapshot failed: {type(error).__name__}: {error}")
        t0 = time.perf_counter()
        if self._summer is not None and self._summer.busy:
            self._summer.wait()  # the slot written now may be the one still being summed
        view = snapshot_view(state)
        plan = self._plan
        # With the copy deferred, the helper checks the plan's tensors (identity, data pointers)
        # when it copies them: nothing may change them before the optimizer step it waits for.
        late_ok = self.overlap and plan is not None and bool(plan.deferred) and self._flats is not None
        flats_ok = False
        if plan is not None and not self._stale and plan.holds_objects(view):
            # The kept tensors still where they were found, at the same addresses: the plan and
            # its flat views hold. One pass; a tensor given new memory keeps the plan, not the
            # views. With the copy deferred the helper runs that check when it copies.
            flats_ok = late_ok or plan.holds_memory(self._flat_ptrs)
            if not flats_ok and not plan.holds_tensors():
                plan = None
        else:
            plan = None
        if plan is None:
            plan = self._plan = CopyPlan(view, (self.rank, self.world_size) if self.share else None)
            self._stale = False
        tensors = list(plan.tensors)
        flats = self._flats if flats_ok else self._flat_sources(plan)
        late = self.overlap and flats is not None and bool(plan.deferred)
        # With a helper to finish the skeleton, the RNG states' bytes are read there (~30 us on a
        # cache a step has just gone through): the pickle gets stand-ins of their length, the first
        # thing in it, which the helper overwrites.
        rng_now = rng_states() if late else None
        try:
            dynamic = self._pickler.dumps({"rng": stand_ins(rng_now) if rng_now is not None else rng_bytes(),
                                           "dynamic": plan.dynamic(view), "meta": self._meta_bytes(meta)}, tensors)
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            self._plan = None
            raise SnapshotError(f"the state holds something snapshots cannot carry: {exc}") from exc
        slot = self._target()
        signature = plan.signature if len(tensors) == len(plan.tensors) else \
            plan.signature + signature_of(tensors[len(plan.tensors):])
        deferred = plan.deferred if late else ()
        # The specs' pickle is ~40 bytes a tensor: a first layout with room for it maps the slot once.
        skeleton_bytes = PARTS.size + len(plan.static_bytes) + len(dynamic) + 64 * len(tensors) + 4096
        try:
            slot.layout(tensors, max(self._last_skeleton, skeleton_bytes), signature, len(plan.tensors), plan.holders,
                        deferred)
            if not slot._room(PARTS.size + len(slot.specs_bytes) + len(plan.static_bytes) + len(dynamic)):
                # a skeleton that outgrew its reserve: a new layout
                slot.layout(tensors, 2 * (len(slot.specs_bytes) + skeleton_bytes), signature, len(plan.tensors),
                            plan.holders, deferred)
        except OSError as exc:
            raise SnapshotError(f"no room for a snapshot of {sum(t.numel() * t.element_size() for t in tensors)} "
                                f"bytes in {self.directory}: {exc}") from exc
        st = self.stats
        st.taken += 1
        st.state_bytes = slot.payload_bytes
        header = None  # the helper writes it where this copies nothing
        if not late or not slot.all_late:  # bytes copied here: the slot is no longer the complete one it was
            header = self._header(step)
            slot.write_header(header)
            slot.copy_in(tensors, flats, False if late else None)
        if late:
            assert flats is not None
            self._guard(plan)
            if self._copier is None:
                self._copier = _Copier()
            job = _LateCopy(self, plan, slot, flats, tensors, dynamic, step, header, rng_now)
            self._copier.submit(job.run)
            blocked = time.perf_counter() - t0
            self._pending = (step, blocked, job)
            st.overlapped += 1
            st.total_stall_s += blocked
            return blocked
        assert header is not None
        slot.finish(plan.static_bytes, dynamic, header)
        self._last_skeleton = slot.skeleton_bytes
        self._sum(slot, step)
        stall = time.perf_counter() - t0
        st.last_step, st.last_stall_s = step, stall
        st.last_cost_s = stall
        st.total_stall_s += stall
        return stall

    def _sum(self, slot: Slot, step: int) -> None:
        """Hand the complete slot's payload to the summing thread (``checksum``)."""
        if not self.checksum:
            return
        if self._summer is None:
            self._summer = _Copier("trainguard-snapshot-sum")
            _WRITERS.add(self)
            if not _AT_FORK:
                os.register_at_fork(before=_wait_all_before_fork)
                _AT_FORK.append(True)
        self._summer.submit(lambda: sum_payload(slot, step))

    def wait_summed(self) -> None:
        """Wait until the newest complete slot's crc32 is recorded (before it may be restored)."""
        self.wait()
        if self._summer is not None:
            self._summer.wait()

    def _header(self, step: int) -> SlotHeader:
        """The header of a slot being written with ``step``."""
        return SlotHeader(WRITING, step, self.attempt, self.world_size, self.rank, 0, 0, 0)

    def _meta_bytes(self, meta: Mapping[str, Any]) -> bytes:
        """``meta`` pickled, once while it stays equal (a run's checkpoint meta changes with its plan)."""
        cached = self._meta_cache
        try:
            same = cached is not None and bool(cached[0] == meta)
        except Exception:  # noqa: BLE001 - a value whose == is no plain answer (an array): pickled anew
            same = False
        if cached is None or not same:
            cached = self._meta_cache = (dict(meta), self._pickler.dumps(dict(meta), []))
        return cached[1]

    def wait(self) -> float:
        """Wait for the deferred copy in flight (none: at once); the seconds waited, which count
        as that snapshot's stall."""
        pending = self._pending
        if pending is None:
            return 0.0
        t0 = time.perf_counter()
        assert self._copier is not None
        if self._copier.busy:
            self._copier.wait()
        waited = time.perf_counter() - t0
        self._pending = None
        st = self.stats
        st.total_stall_s += waited
        if pending[2].done:
            st.last_step, st.last_stall_s = pending[0], pending[1] + waited
            st.last_cost_s = pending[1] + pending[2].cpu_s
        else:
            st.skipped += 1
        return waited

    def _guard(self, plan: CopyPlan) -> None:
        """Hooks that wait for a deferred copy before anything changes what it copies: each
        optimizer's step, each module's and optimizer's ``load_state_dict``, a fork."""
        if plan is self._guarded_plan:
            return
        objects = plan.guarded()
        ids = tuple(map(id, objects))
        self._guarded_plan = plan
        if ids == self._hooked:
            return
        self._unhook()
        me = weakref.ref(self)

        def wait_for_copy(*_: Any, **__: Any) -> None:
            writer = me()
            if writer is not None:
                writer.wait()

        for obj in objects:
            if isinstance(obj, torch.optim.Optimizer):
                self._hooks.append(obj.register_step_pre_hook(wait_for_copy))
            on_load = getattr(obj, "register_load_state_dict_pre_hook", None)  # public on modules since torch 2.5
            if on_load is not None:
                self._hooks.append(on_load(wait_for_copy))
        self._hooked = ids
        _WRITERS.add(self)
        if not _AT_FORK:
            os.register_at_fork(before=_wait_all_before_fork)
            _AT_FORK.append(True)

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._hooked, self._guarded_plan = [], (), None

    def _flat_sources(self, plan: CopyPlan) -> list[torch.Tensor] | None:
        """Per plan tensor, a flat view of it where this rank's slot keeps it (the tensor itself
        elsewhere: no copy here reads it), and the kept ones' addresses, against which ``take``
        checks them before it reuses the views (a view costs ~1 us, a pointer read ~0.1 us; the
        views hold the old storage, so a replaced tensor's memory cannot come back at the same
        address). None: they go one by one."""
        kept = plan.kept_tensors
        self._flat_ptrs = data_ptrs(kept)
        self._flats = None
        if all(t.device.type == "cpu" and t.is_contiguous() for t in kept):
            flats = list(plan.tensors)
            for i in plan.kept:
                flats[i] = plan.tensors[i].detach().view(-1)
            self._flats = flats
        return self._flats

    def check_restorable(self) -> None:
        """Raise SnapshotError when the newest snapshot's skeleton could not be read back (the
        state holds values other than tensors and plain Python data)."""
        self.wait_summed()
        newest = max(self._slots, key=lambda s: s.step)
        found = read_done(newest.path)
        if found is None:
            raise SnapshotError("the snapshot just written cannot be read back")
        try:
            read_skeleton(found[1])
        except (pickle.UnpicklingError, AttributeError, ImportError) as exc:
            raise SnapshotError(f"the state holds something snapshots cannot carry: {exc}") from exc

    def close(self) -> None:
        self.wait_summed()
        self._unhook()
        _WRITERS.discard(self)
        # What the plan found (the script's modules and optimizers) is the script's to let go.
        self._plan = self._flats = None
        self._flat_ptrs = []
        for slot in self._slots:
            slot.close()
