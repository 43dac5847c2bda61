"""The daemon's side of the control API (agent.api.handler.ApiHandler): meaning, not transport."""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Any

from trainguard.agent import __version__
from trainguard.agent.api.handler import ApiError, Blob, BlobReader, Json
from trainguard.agent.cluster.gang import decode_forwarded
from trainguard.agent.lifecycle import rdzvjobs
from trainguard.agent.lifecycle.jobs import JobSpec, JobSpecError
from trainguard.agent.wire import WireError
from trainguard.launch.forward import FORWARDABLE

MAX_FORWARDED = 20_000
EXTERNAL_NOTE = ("started by another launcher (torchrun): trainguard monitors it (telemetry, per-rank eBPF, "
                 "stragglers, plans, memory checkpoints) but cannot restart its ranks")

if TYPE_CHECKING:
    from trainguard.agent.daemon import Agent


class AgentControl:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def _job(self, job: str) -> Any:
        record = self.agent.supervisor.jobs.get(job)
        if record is None:
            raise ApiError(404, f"no job {job!r} on this agent")
        return record

    def _known(self, job: str) -> None:
        """A job this agent launched, or one whose ranks report to it (e.g. a torchrun job)."""
        if job not in self.agent.supervisor.jobs and job not in self.agent.table.jobs():
            raise ApiError(404, f"no job {job!r} on this agent")

    def health(self) -> dict[str, Any]:
        return {"node": self.agent.cfg.agent.node, "version": __version__, "pid": os.getpid()}

    def status(self) -> dict[str, Any]:
        agent = self.agent
        snapshot = agent.table.snapshot()
        jobs = []
        straggler = agent.straggler
        for rec in agent.supervisor.status():
            ranks_tel = snapshot.get(rec["job"], {})
            scores = straggler.scores(rec["job"]) if straggler is not None else {}
            for r in rec["ranks"]:
                tel = ranks_tel.get(r["rank"])
                if tel is not None:
                    r["telemetry"] = _telemetry_dict(tel)
                    if r["rank"] in scores:
                        score, cause, state = scores[r["rank"]]
                        r["telemetry"].update(straggler_score=score, straggler_cause=cause, straggler_state=state)
            rec["plan"] = dataclasses.asdict(agent.plans.get(rec["job"]))
            jobs.append(rec)
        # Telemetry from jobs this agent did not launch (e.g. torchrun pointed at the socket).
        launched = {j["job"] for j in jobs}
        for job, ranks in snapshot.jobs.items():
            if job not in launched:
                jobs.append(
                    {
                        "job": job,
                        "state": "external",
                        "managed": False,
                        "note": EXTERNAL_NOTE,
                        "plan": dataclasses.asdict(agent.plans.get(job)),
                        "ranks": [
                            {"rank": rank, "telemetry": _telemetry_dict(tel)}
                            for rank, tel in sorted(ranks.items())
                        ],
                    }
                )
        threads = agent.health.check()
        return {
            "node": agent.cfg.agent.node,
            "healthy": all(t.healthy for t in threads),
            "threads": [t.as_dict() for t in threads],
            "hostname": socket.gethostname(),
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - agent.started, 3),
            "leader": _leader(agent),
            "cluster": agent.cluster.status(),
            "collectors": {k: {"up": v[0], "reason": v[1]} for k, v in agent.collector_state.items()},
            "jobs": jobs,
            "gpus": _gpu_view(agent),
            "kernel": _kernel_view(agent),
            "metrics_port": agent.metrics_port,
            "api_tcp_port": agent.api_tcp_port,
        }

    def events(self, since: int, limit: int, kind: str | None) -> dict[str, Any]:
        items = self.agent.events.since(since, limit=limit, kind=kind)
        nxt = items[-1]["seq"] if items else max(since, 0)
        return {"events": items, "next": nxt}

    def list_jobs(self) -> Json:
        return self.agent.supervisor.status()

    def submit_job(self, spec: dict[str, Any]) -> dict[str, Any]:
        if isinstance(spec, dict) and "max_restarts" not in spec:
            spec = {**spec, "max_restarts": self.agent.cfg.recovery.max_restarts}
        try:
            job_spec = JobSpec.from_dict(spec)
        except JobSpecError as exc:
            raise ApiError(400, str(exc)) from None
        if job_spec.nodes > 1:
            cluster = self.agent.cluster
            if cluster.gangs is None:
                raise ApiError(400, "nodes: a job over several nodes needs a cluster ([cluster] etcd_endpoints)")
            try:
                cluster.submit_spanning(job_spec.to_dict())
            except ValueError as exc:
                raise ApiError(409, str(exc)) from None
            return {"job": job_spec.job, "placement": "pending: the cluster leader places it"}
        supervisor = self.agent.supervisor
        unreachable = supervisor.launcher.unreachable(job_spec, supervisor.context_for(job_spec))
        if unreachable:
            raise ApiError(400, unreachable)
        try:
            supervisor.submit(job_spec)
        except ValueError as exc:
            raise ApiError(409, str(exc)) from None
        return {"job": job_spec.job}

    def job_attempt(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return rdzvjobs.attempt(self.agent, job, body)
        except ValueError as exc:
            raise ApiError(409 if "not active" in str(exc) or "already" in str(exc) else 400, str(exc)) from None

    def get_job(self, job: str) -> dict[str, Any]:
        result: dict[str, Any] = self._job(job).to_dict()
        launcher = self.agent.supervisor.launcher
        cg = launcher.job_cgroups.get(job)
        if cg is not None:
            use = cg.usage()
            result["cgroup"] = {"paths": [str(p) for p in cg.paths], "limits": dict(cg.limits),
                                "cpu_s": _finite_or_none(use.cpu_s), "memory_bytes": _finite_or_none(use.memory_bytes),
                                "memory_peak_bytes": _finite_or_none(use.memory_peak_bytes),
                                "oom_kills": use.oom_kills, "processes": use.processes}
        return result

    def stop_job(self, job: str, options: dict[str, Any]) -> dict[str, Any]:
        reason = str(options.get("reason", "requested through the API"))
        gangs = self.agent.cluster.gangs
        if gangs is not None and gangs.is_spanning(job):
            # Stopping one node's ranks would only make the leader restart them: stop it everywhere.
            try:
                gangs.stop_job(job, reason)
            except ValueError as exc:
                raise ApiError(409, str(exc)) from None
            return {"job": job, "state": "stopping on every node"}
        self._job(job)
        record = self.agent.supervisor.stop(job, reason)
        return {"job": job, "state": record.state.value}

    def signal_job(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("signal") if isinstance(body, dict) else None
        if name not in FORWARDABLE:
            raise ApiError(400, f"signal: expected one of {', '.join(FORWARDABLE)}, got {name!r}")
        sender = body.get("sender", "the API")
        sender = sender[:64] if isinstance(sender, str) and sender.isprintable() else "the API"
        try:
            sent = self.agent.supervisor.signal(job, int(signal.Signals[name]), sender)
        except KeyError:
            raise ApiError(404, f"no job {job}") from None
        return {"job": job, "signal": name, "ranks": sent}

    def job_output(self, job: str, rank: int, offset: int, limit: int) -> dict[str, Any]:
        record = self._job(job)
        path = next((r.log_path for r in record.ranks if r.rank == rank), None)
        if path is None:
            path = os.path.join(self.agent.paths.jobs_dir, job, f"rank{rank}.log")
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                fh.seek(min(offset, size))
                data = fh.read(limit)
        except FileNotFoundError:
            return {"rank": rank, "offset": offset, "next": offset, "size": 0, "text": ""}
        except OSError as exc:
            raise ApiError(500, f"cannot read the output of rank {rank}: {exc}") from None
        # Whole lines only while more may follow; once the job is over and this read reached the
        # end, a last line without a newline is all there will be of it.
        if not (record.state.finished and len(data) < limit):
            end = data.rfind(b"\n") + 1
            if end == 0 and len(data) < limit:
                data = b""  # half a line: wait for the rest
            elif end:
                data = data[:end]
        start = min(offset, size)
        return {"rank": rank, "offset": start, "next": start + len(data), "size": size,
                "text": data.decode("utf-8", errors="replace")}

    def get_plan(self, job: str) -> dict[str, Any]:
        self._known(job)
        return dataclasses.asdict(self.agent.plans.get(job))

    def update_plan(self, job: str, fields: dict[str, Any]) -> dict[str, Any]:
        self._known(job)
        try:
            plan = self.agent.plans.update(job, fields)
        except (WireError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        self.agent.events.emit("plan_updated", f"plan v{plan.version} for job {job}", job=job, cause="api", plan=_plan_dict(plan))
        return _plan_dict(plan)

    def list_checkpoints(self, job: str | None) -> Json:
        result: Json = self.agent.checkpoints.catalog(job)
        return result

    def checkpoint_now(self, job: str, options: dict[str, Any]) -> dict[str, Any]:
        self._known(job)
        plan = self.agent.plans.update(job, {"reason": "checkpoint requested"}, checkpoint_now=True)
        self.agent.events.emit("checkpoint_requested", f"checkpoint requested for job {job}", job=job, cause="api")
        return {"job": job, "checkpoint_id": plan.checkpoint_id, "plan_version": plan.version}

    def ingest_telemetry(self, job: str, body: dict[str, Any]) -> dict[str, Any]:
        node, messages = body.get("node"), body.get("messages")
        if not isinstance(node, str) or not isinstance(messages, list) or len(messages) > MAX_FORWARDED:
            raise ApiError(400, f'expected {{"node": NAME, "messages": [up to {MAX_FORWARDED} datagram strings]}}')
        record = self.agent.supervisor.jobs.get(job)
        if record is None or record.block is None or record.block.group_rank != 0:
            raise ApiError(409, f"job {job} does not hold rank 0 here; telemetry goes to the node that does")
        good, dropped = decode_forwarded(job, messages)
        result = self.agent.table.add_many(good, time.time())
        dropped += sum(result.rejected.values())
        self.agent.forwarded_in[node] = self.agent.forwarded_in.get(node, 0) + len(result.accepted)
        straggler = self.agent.straggler
        evidence = straggler.note_remote_evidence(job, node, body.get("evidence")) if straggler is not None else 0
        return {"accepted": len(result.accepted), "dropped": dropped, "evidence_ranks": evidence}

    def drain(self, job: str, target: dict[str, Any]) -> dict[str, Any]:
        if not (isinstance(target, dict) and "node" in target and self.agent.cluster.gangs is not None):
            self._job(job)  # a node drain in a cluster may name any cluster job: its record decides
        return self.agent.drain(job, target)

    def get_detection_config(self) -> dict[str, Any]:
        straggler = self.agent.straggler
        return dict(straggler.detection_config()) if straggler is not None else {}

    def update_detection_config(self, fields: dict[str, Any]) -> dict[str, Any]:
        straggler = self.agent.straggler
        if straggler is None:
            raise ApiError(501, "no runtime-changeable detection settings on this agent")
        try:
            result: dict[str, Any] = straggler.update_detection(fields)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return result

    def put_blob(self, namespace: str, path: str, body: BlobReader) -> dict[str, Any]:
        result: dict[str, Any] = self.agent.cluster.store.put(namespace, path, body)
        return result

    def get_blob(self, namespace: str, path: str) -> Blob:
        blob: Blob = self.agent.cluster.store.get(namespace, path)
        return blob

    def delete_blob(self, namespace: str, path: str) -> dict[str, Any]:
        result: dict[str, Any] = self.agent.cluster.store.delete(namespace, path)
        return result


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _plan_dict(plan: Any) -> dict[str, Any]:
    return dataclasses.asdict(plan)


def _telemetry_dict(tel: Any) -> dict[str, Any]:
    if hasattr(tel, "to_dict"):
        result: dict[str, Any] = tel.to_dict()
        return result
    if dataclasses.is_dataclass(tel) and not isinstance(tel, type):
        return dataclasses.asdict(tel)
    return dict(tel)


def _gpu_view(agent: Agent) -> dict[str, Any]:
    """Latest GPU readings by index (empty without the GPU collector)."""
    gpu = agent.gpu
    if gpu is None:
        return {}
    out: dict[str, Any] = {}
    for index, reading in gpu.readings().items():
        body = dataclasses.asdict(reading)
        out[str(index)] = {k: v for k, v in body.items() if not (isinstance(v, float) and v != v)}
    return out


def _kernel_view(agent: Agent) -> dict[str, Any]:
    """Cumulative log2 latency histograms (run queue per node and rank, block I/O per device)."""
    ebpf = agent.ebpf
    snap = ebpf.snapshot if ebpf is not None else None
    if snap is None:
        return {}

    def hist(h: Any) -> dict[str, Any]:
        return {"slots": list(h.slots), "sum_ns": int(h.sum_ns)}

    view: dict[str, Any] = {}
    if snap.runq is not None:
        series = {"node": hist(snap.runq.node)}
        for slot, h in snap.runq.ranks.items():
            pid = snap.owners.get(slot)
            found = agent.supervisor.find_rank(pid) if pid else None
            label = f"{found[0].job} rank {found[1].rank}" if found else f"pid {pid}"
            series[label] = hist(h)
        view["runqueue"] = series
    if snap.blockio is not None:
        view["block_io"] = {f"dev {dev >> 20}:{dev & 0xFFFFF}": hist(h) for dev, h in snap.blockio.devices.items()}
    return view


def _leader(agent: Agent) -> str | None:
    leader: str | None = agent.cluster.leader
    return leader
