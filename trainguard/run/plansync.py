"""One plan version on every rank at the same step, without a collective per step.

At each sync point (every ``every`` steps, more when steps are short: ``PlanSync``), rank 0 reads
the agent's plan file and puts the plan it sees into the job's c10d store under the sync point's
number; the other ranks read the key of the previous sync point, and all of them apply that plan
from the next step. In synchronous training
rank 0 passed the previous sync point before any rank could finish this one's step (their gradient
collectives meet), so the read finds its key at once: one small store round trip per sync point,
no collective, and nothing left in flight when the script tears its process group down (an
asynchronous broadcast pending at exit can block a rank's exit once its peers have destroyed the
group). A plan takes effect at most two sync points after the agent wrote it: ``2 x every`` steps, or
about ``2 x target_s`` seconds when steps are short.

The round trips run off the training thread (``_StoreThread``), on a store connection of their
own: rank 0's write goes out while it trains on, and every other rank fetches a sync point's key
while it trains towards the next point, where it finds the plan already in. Made on the training
thread, a round trip took 0.09-0.13 ms a step on every rank of the recovery bench's 4 ranks on 2
cores, up to 4 ms at a sync point whose store thread was not scheduled at once.

The same points carry rank 0's choice of the automatic snapshot interval (``snapshot_every``), so
that every rank snapshots the same steps: ranks that tuned their intervals apart would share no
step in their two slots, and a crash would restore nothing newer than the last DCP checkpoint.

The store is the one the process group was initialised with (the job's rendezvous store); keys
carry the attempt (the cluster's, for a job spanning nodes), so a restarted job never reads a
previous attempt's plans and a node new to the job meets the others under the same keys.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainguard.agent.wire import Plan
from trainguard.run.environment import plan_prefix
from trainguard.run.link import PlanWatcher

_TIMEOUT = timedelta(seconds=300)
_KEEP = 3  # rank 0 deletes keys this many steps old: every rank has read them by then


def _job_store() -> Any:
    # The default group's store is not public API, but it is the one store every init method
    # (env://, tcp://, file://, torchrun's agent store) gives the job; fall back to env:// otherwise.
    store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()
    if store is not None:
        return store
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=_TIMEOUT)


class _Result:
    """What a job of ``_StoreThread`` gave (or raised), once it is done."""

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()
        self.value: Any = None
        self.error: BaseException | None = None

    def finish(self) -> None:
        self._done.release()

    @property
    def done(self) -> bool:
        return not self._done.locked()

    def get(self) -> Any:
        """The job's value, waiting for it (the store's own timeout bounds the job); its error raised."""
        with self._done:
            pass
        if self.error is not None:
            raise self.error
        return self.value


class _StoreThread:
    """One thread of the rank that makes a sync point's store round trips while training goes on,
    on a clone of the store (``Store.clone``: a connection of its own). A store client runs one
    request at a time: a fetch waiting on the shared one for a key rank 0 writes at its next sync
    point would hold up every request of the process group's own for as long."""

    def __init__(self, store: Any) -> None:
        self.store = store.clone()
        self._jobs: queue.SimpleQueue[tuple[Callable[[Any], Any], _Result]] = queue.SimpleQueue()
        # A daemon: idle on its queue between sync points, it must not hold the rank's exit.
        threading.Thread(target=self._loop, name="trainguard-plan-sync", daemon=True).start()

    def submit(self, job: Callable[[Any], Any]) -> _Result:
        result = _Result()
        self._jobs.put((job, result))
        return result

    def _loop(self) -> None:
        while True:
            job, result = self._jobs.get()
            try:
                result.value = job(self.store)
            except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the next point
                result.error = exc
            result.finish()


SYNC_TARGET_S = 0.3
"""Seconds of training between two sync points that rank 0 aims for when steps are short. A plan
then takes effect within ~0.6 s, less than the agent's 1 s detection interval that decides it; at
0.1 s the sync points' round trips (~1 ms each on a loaded 2-core node, the other ranks waiting
for rank 0 to be scheduled) were ~0.8 % of a 4-rank job's 33 ms steps."""
MAX_GAP = 256


class PlanSync:
    """``every``: the fewest steps between two sync points. Rank 0 widens the gap when steps are
    short, so that sync points come about every ``target_s`` seconds: a store round trip costs
    ~0.2-0.6 ms, a tenth of a 4 ms step. The gaps are agreed like the plans: each published value
    carries the gap after the next sync point, decided by rank 0 one point ahead, so every rank
    knows where the next point is without asking."""

    def __init__(self, watcher: PlanWatcher, *, is_leader: bool, attempt: int, every: int = 4,
                 target_s: float = SYNC_TARGET_S) -> None:
        self.watcher = watcher
        self.is_leader = is_leader
        self.every = max(1, every)
        self.target_s = target_s
        self.store = dist.PrefixStore(plan_prefix(attempt), _job_store())
        self._step = 0
        self._at = 0  # the next sync point's step
        self._gap = self.every  # steps from the next sync point to the one after it
        self._last = Plan()
        self._last_snapshot_every = 0
        self.snapshot_every = 0
        """The snapshot interval every rank uses from the last sync point (0: none agreed yet)."""
        self.points = 0
        """Sync points passed (each one store round trip); also the next one's number."""
        self._thread: _StoreThread | None = None
        self._inline = False
        """The store cannot be cloned: round trips stay on the training thread."""
        self._sent: _Result | None = None
        """Rank 0: its newest write, still going out or done."""
        self._fetch: tuple[str, _Result] | None = None
        """Other ranks: (key, its fetch) of the sync point they train towards."""
        self._fetch_at = -1
        """Other ranks: the step after which that fetch starts (one after the last sync point)."""

    def _put(self, key: str, plan: Plan, gap: int, snapshot_every: int) -> None:
        self.store.set(key, self._encode(plan, gap, snapshot_every))

    @staticmethod
    def _encode(plan: Plan, gap: int, snapshot_every: int) -> str:
        return f"{gap} {snapshot_every} {plan.encode().decode()}"

    @staticmethod
    def _decode(raw: bytes) -> tuple[Plan, int, int]:
        gap, snapshot_every, body = raw.decode().split(" ", 2)
        return Plan.decode(body.encode()), max(1, int(gap)), max(0, int(snapshot_every))

    def _get(self, key: str) -> tuple[Plan, int, int]:
        return self._decode(self.store.get(key))  # waits for the key (store timeout)

    def _background(self) -> _StoreThread | None:
        if self._thread is None and not self._inline:
            try:
                self._thread = _StoreThread(self.store)
            except (AttributeError, RuntimeError, NotImplementedError):
                self._inline = True
        return self._thread

    def _publish(self, point: int, value: str) -> None:
        """Rank 0: write the sync point's key, and drop one every rank has read, off the training
        thread. A write that failed is raised here, at the next point."""
        sent = self._sent
        if sent is not None and sent.done and sent.error is not None:
            self._sent = None
            raise sent.error
        key, drop = str(point), str(point - _KEEP) if point >= _KEEP else None

        def write(store: Any) -> None:
            store.set(key, value)
            if drop is not None:
                try:
                    store.delete_key(drop)
                except (RuntimeError, AttributeError):
                    pass  # a store that cannot delete keeps a few bytes per sync point

        worker = self._background()
        if worker is None:
            write(self.store)
        else:
            self._sent = worker.submit(write)

    def _prefetch(self, key: str) -> None:
        """Another rank, one step after a sync point: fetch that point's key in the background for
        the next point. Rank 0 wrote it before this rank could finish the step (their gradient
        collectives meet), so the fetch finds it at once and no fetch is left waiting on a key
        when the job ends."""
        worker = self._background()
        if worker is not None:
            self._fetch = (key, worker.submit(lambda store: store.get(key)))

    def _read(self, key: str) -> tuple[Plan, int, int]:
        """Another rank: the value under ``key``, from its fetch when one was made. A fetch that
        failed is made again here, where a failure is the caller's."""
        fetch, self._fetch = self._fetch, None
        raw: bytes | None = None
        if fetch is not None and fetch[0] == key:
            try:
                raw = fetch[1].get()
            except Exception:  # noqa: BLE001 - read once more below
                raw = None
        return self._decode(raw) if raw is not None else self._get(key)

    def _next_gap(self, step_s: float) -> int:
        if step_s <= 0:
            return self.every
        return max(self.every, min(MAX_GAP, math.ceil(self.target_s / step_s)))

    def initial(self, snapshot_every: int = 0) -> Plan:
        """Once, at the first step: every rank starts from the plan rank 0 sees now."""
        if self.is_leader:
            self._last = self.watcher.poll()
            self._last_snapshot_every = snapshot_every
            self._put("start", self._last, self._gap, snapshot_every)
            return self._last
        plan, self._gap, _ = self._get("start")
        return plan

    def after_step(self, step_s: float = 0.0, snapshot_every: int = 0) -> Plan | None:
        """At the end of every step, on every rank: the plan to apply from the next step (the same
        one on every rank), or None between sync points. At a sync point rank 0 publishes what it
        sees (and the gap after the next point, from ``step_s``, its last step's seconds, and the
        snapshot interval it wants, ``snapshot_every``; other ranks' value is ignored) and the
        others take what it published one sync point earlier; ``self.snapshot_every`` then holds
        that point's agreed interval on every rank."""
        step = self._step
        self._step += 1
        if step == self._fetch_at:
            self._prefetch(str(self.points - 1))
        if step < self._at:
            return None
        point = self.points
        self.points += 1
        if not self.is_leader:
            plan, gap_after, self.snapshot_every = self._read("start" if point == 0 else str(point - 1))
            if point > 0:
                self._gap = gap_after  # at point 0 the gap came with the start key
            self._at = step + self._gap
            if self._gap > 1:  # else the next point reads it at once
                self._fetch_at = step + 1
            return plan
        self._at = step + self._gap
        self._gap = self._next_gap(step_s)
        plan = self.watcher.poll()
        self._publish(point, self._encode(plan, self._gap, snapshot_every))
        self.snapshot_every, self._last_snapshot_every = self._last_snapshot_every, snapshot_every
        previous, self._last = self._last, plan
        return previous
