"""The records of jobs that run on one node, as this agent keeps them in etcd: its own jobs
published, jobs assigned to it started (a lost node's job taken over, a fenced one claimed again),
and, on the leader, jobs of lost or drained nodes moved elsewhere (``ClusterService`` inherits these)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from trainguard.agent.cluster.etcd import EtcdUnavailable
from trainguard.agent.cluster.gang import Gang, GangCoordinator
from trainguard.agent.cluster.grace import MissingClock
from trainguard.agent.cluster.jobs import JobRecordDoc, JobTable, plan_moves
from trainguard.agent.cluster.membership import EmitFn, Membership, NodeInfo
from trainguard.agent.cluster.peertier import PeerRef

if TYPE_CHECKING:
    from trainguard.agent.lifecycle.plans import PlanStore
    from trainguard.agent.lifecycle.supervisor import Supervisor

log = logging.getLogger("trainguard.cluster")


class JobRecords:
    """The job-record half of ``ClusterService``: the attributes below are set by its constructor."""

    node: str
    emit: EmitFn
    jobs: JobTable | None
    membership: Membership | None
    supervisor: Supervisor | None
    plans: PlanStore | None
    gangs: GangCoordinator | None
    on_adopt: Callable[[str, float], None] | None
    _clock: Callable[[], float]
    _epochs: dict[str, int]
    _fenced: dict[str, str]
    _conflicts: set[str]
    _missing: MissingClock
    moves: int
    adoptions: int
    peer: Callable[[], PeerRef | None]
    members: Callable[[], dict[str, NodeInfo]]
    _wake: Callable[[], None]

    def _publish(self, records: dict[str, tuple[JobRecordDoc, int]], spanning: set[str]) -> None:
        assert self.jobs is not None and self.supervisor is not None
        peer = self.peer()
        for job, local in list(self.supervisor.jobs.items()):
            if job in spanning or local.block is not None or job in self._fenced:
                continue
            cur = records.get(job)
            mine = self._epochs.get(job)
            if cur is not None and cur[0].node != self.node:
                if mine is not None and cur[0].epoch > mine and not local.state.finished:
                    self.supervisor.stop(job, f"job moved to {cur[0].node} (epoch {cur[0].epoch})")
                    self.emit("job_fenced", f"job {job} now runs on {cur[0].node}; stopping the copy here",
                              {"job": job, "owner": cur[0].node, "severity": "warning"})
                    self._epochs[job] = cur[0].epoch
                elif mine is None and cur[0].state == "running" and not local.state.finished \
                        and self.membership is not None and self.membership.waited_for_name:
                    # Ranks this agent took over from its crashed previous run, whose lease expired
                    # while it waited for the node name: the leader has placed the job elsewhere.
                    self.supervisor.stop(job, f"job moved to {cur[0].node} (epoch {cur[0].epoch}) while this "
                                         "node's previous lease expired", hard=True)
                    self.emit("job_fenced", f"job {job} now runs on {cur[0].node} (moved while this node's previous "
                              "lease expired); stopping the copy here",
                              {"job": job, "owner": cur[0].node, "severity": "warning"})
                    self._epochs[job] = cur[0].epoch
                elif mine is None and cur[0].state == "running" and job not in self._conflicts \
                        and not local.state.finished:
                    self._conflicts.add(job)
                    self.emit("job_conflict", f"job {job} already runs on {cur[0].node}",
                              {"job": job, "owner": cur[0].node, "severity": "warning"})
                continue
            if cur is not None and mine is not None and cur[0].epoch < mine:
                continue
            state = "finished" if local.state.finished else "running"
            base = cur[0] if cur is not None else None
            desired = JobRecordDoc(job, local.spec.to_dict(), self.node, peer.node if peer else "", state,
                                   base.epoch if base else 0, base.cause if base else "submitted",
                                   base.history if base else [self.node], self._plan_of(job, base),
                                   drained=base.drained if base else [])
            if base is not None and base == desired:
                self._epochs[job] = desired.epoch
                continue
            if self.jobs.write(desired, cur[1] if cur is not None else 0):
                self._epochs[job] = desired.epoch

    def _plan_of(self, job: str, base: JobRecordDoc | None) -> dict[str, Any]:
        if self.plans is None:
            return dict(base.plan) if base is not None else {}
        plan = self.plans.get(job)
        return {"lr_scale": plan.lr_scale, "lr": plan.lr, "batch_sizes": plan.batch_sizes}

    def _carry_plan(self, job: str, rec: JobRecordDoc, dp: int) -> None:
        """Before the adopted job starts: its LR/batch settings as they were on the lost node."""
        if self.plans is None or not rec.plan:
            return
        fields: dict[str, Any] = {k: rec.plan[k] for k in ("lr_scale", "lr") if k in rec.plan}
        sizes = rec.plan.get("batch_sizes")
        if isinstance(sizes, list) and len(sizes) == dp:
            fields["batch_sizes"] = sizes
        fields["reason"] = f"taken over from node {rec.history[-1].split('->')[0] if rec.history else '?'}"
        try:
            self.plans.update(job, fields)
        except Exception as exc:  # noqa: BLE001 - a bad carried plan must not block the restart
            log.warning("job %s: plan not carried over: %s", job, exc)

    def _adopt(self, records: dict[str, tuple[JobRecordDoc, int]]) -> None:
        assert self.supervisor is not None
        from trainguard.agent.lifecycle.jobs import JobSpec, JobSpecError

        for job, (rec, rev) in records.items():
            if job in self._fenced and rec.node != self.node:
                del self._fenced[job]  # moved on: the record's owner runs it
                self._epochs[job] = rec.epoch
            if rec.node != self.node or rec.state != "running" or self._epochs.get(job, -1) >= rec.epoch:
                continue
            local = self.supervisor.jobs.get(job)
            if local is not None and not local.state.finished:
                self._epochs[job] = rec.epoch
                continue
            if job in self._fenced:
                # Fenced here and still ours: claim a new epoch first, so that a leader moving it
                # at the same time (it saw our lease expire) and this restart cannot both win.
                claimed = replace(rec, epoch=rec.epoch + 1, cause=f"restarted after fence ({self._fenced[job]})",
                                  history=[*rec.history, f"{self.node}->{self.node}"][-20:])
                if not self.jobs or not self.jobs.write(claimed, rev):
                    continue
                del self._fenced[job]
                rec = claimed
            try:
                spec = JobSpec.from_dict(rec.spec)
                par = spec.trainer.get("parallel", {}) if isinstance(spec.trainer, dict) else {}
                dp = int(par.get("dp", spec.nproc)) if isinstance(par, dict) else spec.nproc
                self._carry_plan(job, rec, dp)
                if self.on_adopt is not None:
                    self.on_adopt(job, self._clock())
                self.supervisor.submit(spec)
            except (JobSpecError, ValueError) as exc:
                self.emit("job_adopt_failed", f"cannot take over job {job}: {exc}",
                          {"job": job, "severity": "error"})
                self._epochs[job] = rec.epoch
                continue
            self._epochs[job] = rec.epoch
            self.adoptions += 1
            src = rec.history[-1].split("->")[0] if rec.history else "?"
            self.emit("job_adopted", f"job {job} taken over from node {src} "
                      f"({rec.cause}); restoring from the newest checkpoint across tiers",
                      {"job": job, "epoch": rec.epoch, "cause_": rec.cause, "nproc": spec.nproc, "severity": "warning"})

    def _heal(self, records: dict[str, tuple[JobRecordDoc, int]]) -> None:
        assert self.jobs is not None and self.membership is not None
        members = {n: i.slots for n, i in self.membership.members().items()}
        # A lost owner's job moves only a grace after its key was first seen gone (its ranks are
        # fenced by then); a drained owner is still a member and moves at once.
        now = self._clock()
        running = [r.node for r, _ in records.values() if r.state == "running" and not r.gang]
        self._missing.observe(running, members, now)
        records = {j: r for j, r in records.items() if r[0].node in members or self._missing.ready(r[0].node, now)}
        due = self._missing.next_due(now)
        if due is not None and self.gangs is not None:
            self.gangs.wake_in(due)
        for new, rev, move in plan_moves(records, members):
            if self.jobs.write(new, rev, leader=self.membership.claim()):
                self.moves += 1
                how = "drained" if new.cause.endswith("drained") else "lost"
                self.emit("job_moved", f"leader moves job {move.job} from {how} node {move.src} to {move.dst}"
                          + (f" ({move.reason})" if move.reason else ""),
                          {"job": move.job, "src": move.src, "dst": move.dst, "epoch": move.epoch,
                           "action": "restart_elsewhere", "cause_": new.cause, "severity": "warning"})

    def drain(self, job: str, node: str) -> dict[str, Any]:
        """Record that ``job`` must leave ``node``; the leader moves it at its next sync. Raises
        ValueError (no such job, not on that node, nowhere else to go) or EtcdUnavailable."""
        if self.jobs is None or self.membership is None:
            raise ValueError("no cluster: set [cluster] etcd_endpoints")
        if not self.membership.etcd_reachable:
            raise EtcdUnavailable("etcd is unreachable: the drain cannot be recorded")
        for _ in range(5):  # compare-and-swap: retry when another agent wrote the record meanwhile
            cur = self.jobs.read().get(job)
            if cur is None:
                raise LookupError(f"job {job} has no cluster record")
            rec, rev = cur
            on = Gang.from_dict(rec.gang).nodes if rec.gang else [rec.node]
            if node not in on:
                raise ValueError(f"job {job} does not run on node {node} (it runs on {', '.join(on) or 'none yet'})")
            if rec.state != "running":
                raise ValueError(f"job {job} is {rec.state}: nothing to move")
            others = [n for n in self.members() if n != node and n not in rec.drained]
            if not others:
                raise ValueError(f"no other live node for job {job}: draining {node} would leave it nowhere to run")
            if node in rec.drained:
                return {"job": job, "drained_node": node, "state": "already draining"}
            if self.jobs.write(replace(rec, drained=[*rec.drained, node]), rev):
                self.emit("node_drain_requested", f"job {job}: drain of node {node} recorded; the leader "
                          "moves its ranks off at the next restart point", {"job": job, "node": node})
                self._wake()
                return {"job": job, "drained_node": node, "state": "recorded", "moves_to": sorted(others)}
        raise ValueError(f"job {job}: its record kept changing; drain not recorded, try again")
