"""Straggler detection and shard migration on real training jobs, slowness injected for real.

An in-process agent launches the embedded trainer (gloo, CPU) and the straggler service runs on its
tick. Three kinds of real slowness: the trainer's ``slow`` fault (burns CPU in the rank), a CPU hog
pinned to the same core as a rank (needs eBPF for the run-queue cause), and a rank moved into a CPU
cgroup with a quota (cgroup v1 ``cpu`` controller or v2 ``cpu.max``).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import CPU_ISOLATION
from tests.helpers.jobs import trainer_spec
from trainguard.agent.config import AgentConfig, apply_state_dir
from trainguard.agent.daemon import Agent
from trainguard.agent.detect import StragglerConfig, StragglerService, install
from trainguard.agent.detect.jobview import step_samples
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.demo.nodefaults import CpuCgroup, pin, start_cpu_hog

pytestmark = pytest.mark.xdist_group(CPU_ISOLATION)

FAST = StragglerConfig(window=12, warmup_steps=8, enter_windows=2, leave_windows=2, eval_every_steps=3,
                       settle_steps=5, delay_window_s=3.0)


class Harness:
    def __init__(self, tmp: Path, config: StragglerConfig, ebpf: bool) -> None:
        cfg = apply_state_dir(AgentConfig(), str(tmp))
        cfg.metrics.addr = "127.0.0.1:0"
        cfg.collectors.ebpf = ebpf
        cfg.collectors.gpu = False
        cfg.detection = config  # the daemon installs the straggler service with it
        self.agent = Agent(cfg)
        self.agent.start()
        self.service: StragglerService = install(self.agent)
        assert self.service.config == config and self.agent.tick_hooks.count(self.service) == 1

    def submit(self, job: str, nproc: int, trainer: dict[str, Any]) -> None:
        self.agent.supervisor.submit(JobSpec.from_dict({"job": job, "nproc": nproc, "trainer": trainer}))

    def events(self, kind: str, job: str) -> list[dict[str, Any]]:
        return [e for e in self.agent.events.since(0, 100000, kind) if e.get("job") == job]

    def step(self, job: str) -> int:
        ranks = self.agent.table.snapshot().jobs.get(job, {})
        return min((v.step for v in ranks.values()), default=-1)

    def run_until(self, cond: Callable[[], bool], timeout: float, job: str, interval: float = 0.25) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.agent.tick(time.time())
            if cond():
                return True
            rec = self.agent.supervisor.jobs.get(job)
            if rec is not None and rec.state.finished:
                self.agent.tick(time.time())
                return cond()
            time.sleep(interval)
        return False

    def pids(self, job: str) -> dict[int, int]:
        rec = self.agent.supervisor.jobs[job]
        return {r.rank: r.pid for r in rec.ranks}

    def close(self) -> None:
        self.agent.shutdown()


@pytest.fixture
def harness_factory(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    made: list[Harness] = []

    def make(config: StragglerConfig = FAST, ebpf: bool = False) -> Harness:
        h = Harness(tmp_path / f"agent{len(made)}", config, ebpf)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


@pytest.mark.usefixtures("cpu_priority")
def test_slow_fault_detected_migrated_converges_and_recovers(harness_factory: Callable[..., Harness]) -> None:
    """4-rank dp job; rank 1 runs 3x slower on steps [20, 200): detected within the window, batch
    moved away from it until per-rank compute times converge, shares even again once it recovers."""
    # The slow fault burns CPU inside the rank's compute, which the trainer's CPU-time figure sees
    # directly; run delay stays out so that other processes' load on this small shared machine
    # (several times the cores) does not add stragglers of its own to this test.
    h = harness_factory(replace(FAST, include_run_delay=False))
    job = "slowfault"
    # 600 steps: room after the undo at ~step 250 on a loaded machine; the test stops it when done.
    h.submit(job, 4, trainer_spec(4, 600, ["slow:rank=1,factor=3,step=20,until=200"], batch=64))
    assert h.run_until(lambda: bool(h.events("shard_migration", job)), 120, job), "no migration"
    det = h.events("straggler_detected", job)
    assert [e["rank"] for e in det] == [1], det  # the slowed rank, and no other
    assert 20 < det[0]["fields"]["step"] <= 20 + 2 * FAST.window, det[0]
    first = h.events("shard_migration", job)[0]["fields"]
    assert first["batch_sizes"][1] < 16 and sum(first["batch_sizes"]) == 64
    # Converged: late in the slow period (after the re-balances settled), rank 1's compute per
    # step is close to the others' (it was ~3x before migration).
    def converged() -> bool:
        # The slow period is long enough for the re-balances to settle on a loaded machine (a fresh
        # CI machine measured 1.36-1.41 at steps 95-119 of a period ending at 120).
        # The detector's samples (parts of messages, trainguard.run.stepwindow) of steps 175-198.
        ws = {r: step_samples(h.agent.table.window(job, r, None)) for r in range(4)}
        if min((w[-1].step if w else 0) for w in ws.values()) < 199:
            return False
        ws = {r: [x for x in w if 175 <= x.step < 199] for r, w in ws.items()}
        assert min(len(w) for w in ws.values()) >= 6, {r: len(w) for r, w in ws.items()}
        med = {r: sorted(x.fwd_bwd_s + x.opt_s for x in w)[len(w) // 2] for r, w in ws.items()}
        others = sorted(med[r] for r in (0, 2, 3))[1]
        converged.ratio = med[1] / others  # type: ignore[attr-defined]
        return True

    assert h.run_until(converged, 120, job), "job did not reach step 199"
    # 3x before migration; under a loaded CI machine (bench smoke tests beside it) 1.36-1.74 was seen.
    assert 0.7 < converged.ratio < 2.0, (converged.ratio, h.events("shard_migration", job))  # type: ignore[attr-defined]
    # Recovery: rank 1 back to full speed from step 200 -> recovered, shares even again.
    def story() -> str:  # what a failure here needs to tell stuck from slow (a str: pytest shows it whole)
        return repr({"steps": {r: v.step for r, v in h.agent.table.snapshot().jobs[job].items()},
                "migrations": [(e["fields"].get("step"), e["fields"]["action"], e["fields"]["batch_sizes"])
                               for e in h.events("shard_migration", job)],
                "stragglers": [(e["kind"], e["rank"], e["fields"].get("step"), e["fields"].get("score"))
                               for e in h.events("straggler_detected", job) + h.events("straggler_recovered", job)],
                "scores": h.service.scores(job), "fixed_samples": h.service.fixed_samples(job)})

    assert h.run_until(lambda: bool([e for e in h.events("straggler_recovered", job) if e["rank"] == 1])
                       and h.agent.plans.get(job).batch_sizes is None, 120, job), story()
    later = h.events("straggler_detected", job)
    # Rank 1 once. Another rank may be blamed for a while later, when this shared machine's other
    # load (the other xdist worker) really slows its CPU time per sample: a matmul-and-memcpy load
    # beside the test made rank 2 1.7x slower per sample for ~40 steps (score 0.58, cause unknown),
    # and CI saw the same. Such a rank must have been judged recovered by the end (shares even again,
    # checked below); the first migration above is the check that a healthy rank is not blamed.
    # The same holds for rank 1 once it was judged recovered (CI saw it blamed a second time after
    # that); while slow it is found once.
    recovered = h.events("straggler_recovered", job)
    first_back = min(e["seq"] for e in recovered if e["rank"] == 1)
    ones = [e for e in later if e["rank"] == 1]
    assert all(e["seq"] > first_back for e in ones[1:]), [(e["rank"], e["seq"], e["fields"]) for e in later]
    assert len([e for e in recovered if e["rank"] == 1]) >= len(ones), [(e["rank"], e["seq"]) for e in later + recovered]
    others = {e["rank"] for e in later} - {1}
    assert others <= {e["rank"] for e in recovered}, [(e["rank"], e["fields"]) for e in later]
    # The same figures through the agent's exporter and its control API.
    reg = h.agent.exporter.registry
    same_cause = [e for e in later if e["cause"] == det[0]["cause"]]
    assert reg.get_sample_value("trainguard_stragglers_detected_total", {"job": job, "cause": det[0]["cause"]}) == len(same_cause)
    assert reg.get_sample_value("trainguard_shard_migrations_total", {"job": job}) >= 2
    assert 0.0 < reg.get_sample_value("trainguard_rank_straggler_score", {"job": job, "rank": "1"}) <= 1.0
    status = {r["rank"]: r for j in h.agent.control.status()["jobs"] if j["job"] == job for r in j["ranks"]}
    assert status[1]["telemetry"]["straggler_state"] in ("healthy", "recovering", "straggler")
    from trainguard.agent.api.handler import ApiError
    assert h.agent.control.update_detection_config({"mad_k": 3.5})["mad_k"] == 3.5
    assert h.agent.control.get_detection_config()["mad_k"] == 3.5 and h.service.config.mad_k == 3.5
    with pytest.raises(ApiError, match="detection.enter_score"):
        h.agent.control.update_detection_config({"enter_score": 1.5})
    undo = h.events("shard_migration", job)[-1]["fields"]
    assert undo["action"] == "undo" and undo["batch_sizes"] == [16, 16, 16, 16]
    # The ranks train on even shares again. The service forgets a job once it ends (the table keeps
    # its last telemetry): a slow CI machine once reached the undo near the last step, and the job's
    # end then read as shares never evened out.
    def even_again() -> bool:
        finished = h.agent.supervisor.jobs[job].state.finished
        return ((finished or h.service.batch_sizes(job) == [16, 16, 16, 16])
                and all(v.batch_size == 16 for v in h.agent.table.snapshot().jobs[job].values()))

    assert h.run_until(even_again, 60, job), (
        h.service.batch_sizes(job), {r: (v.step, v.batch_size) for r, v in h.agent.table.snapshot().jobs[job].items()},
        h.events("shard_migration", job)[-2:], h.agent.supervisor.jobs[job].state)
    h.agent.supervisor.stop(job, "test done")


# Elsewhere the attribution itself is still checked from given evidence and a fake /proc
# (test_straggler_units.py: test_cause_precedence_and_thresholds, test_proc_reader_cgroup_v1_and_v2).
@pytest.mark.skipif(os.geteuid() != 0, reason="moving processes into CPU cgroups needs root")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs: one for the healthy rank, one shared")
def test_pinned_cpu_hog_then_cpu_quota_are_attributed(harness_factory: Callable[..., Harness]) -> None:
    """2-rank job, rank 0 pinned to CPU 0 and rank 1 to CPU 1. CPU hogs pinned to CPU 1 make rank 1
    a straggler with cause cpu_contention (from eBPF run-queue latency); then rank 0 under a small
    CPU quota becomes one with cause cpu_quota (from its cgroup's throttled time).

    Each rank runs in a CPU cgroup of its own with 10x the default weight, and the hogs join rank 1's:
    on this small machine, shared with other engineers' processes, the ranks would otherwise be
    slowed at random by everything else (and the load balancer would move other tasks away from
    the hog's core, spreading its pain over both ranks). The weight keeps the rest of the machine
    out; within rank 1's cgroup the hogs take their share of what rank 1 had, as on a quiet node."""
    try:
        probe = CpuCgroup("tg-test")
    except OSError:
        pytest.skip("needs a CPU cgroup controller (v1 cpu or v2 cpu) to isolate the ranks from other load")
    probe.remove()
    h = harness_factory(ebpf=True)
    # Without eBPF (no kernel headers, an old kernel) the run delay comes from /proc schedstat:
    # the same cause must be found, from the other source.
    source = "ebpf" if h.agent.collector_state.get("ebpf", (False,))[0] else "schedstat"
    job = "contention"
    h.submit(job, 2, trainer_spec(2, 5000, batch=48))
    groups: list[CpuCgroup] = []
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        assert h.run_until(lambda: h.step(job) >= 3, 90, job), "job did not start"
        pids = h.pids(job)
        for rank in (0, 1):
            g = CpuCgroup("tg-test")
            groups.append(g)
            g.weight(10)
            g.add(pids[rank])
            pin(pids[rank], rank)
        base = h.step(job)
        assert h.run_until(lambda: h.step(job) >= base + FAST.warmup_steps + FAST.window + 4, 60, job)
        assert not h.events("straggler_detected", job)
        # Two hogs: a rank that sleeps on collectives half the time wins the CPU back on each
        # wake-up from one hog (the scheduler favours sleepers), less so from two.
        hogs = [start_cpu_hog(1) for _ in range(2)]
        for p in hogs:
            groups[1].add(p.pid)
        def of_rank1(kind: str) -> list[dict[str, Any]]:
            return [e for e in h.events(kind, job) if e["rank"] == 1]

        assert h.run_until(lambda: bool(of_rank1("straggler_detected")), 60, job), \
            ("hog not detected", h.events("straggler_detected", job))
        ev = of_rank1("straggler_detected")[0]
        # Rank 0 shares CPU 0 with whatever else the machine runs (the suite's other worker): a
        # verdict it gets from that is not one this test caused, and must name no cause of ours.
        others = [e for e in h.events("straggler_detected", job) if e["rank"] != 1]
        assert all(e["cause"] == "unknown" for e in others), others
        named = ev
        if ev["cause"] == "unknown":
            # Detected on its first slow steps, before the run delay caught up: the agent names the
            # cause with the next ticks' evidence (tests/detect/test_straggler_units.py covers that path).
            assert h.run_until(lambda: bool(of_rank1("straggler_cause")), 30, job), ev["fields"]
            named = of_rank1("straggler_cause")[0]
        assert named["cause"] == "cpu_contention", named["fields"]
        assert named["fields"]["details"]["run_delay_source"] == source
        for p in hogs:
            p.kill()
            p.wait()
        # The quota phase starts from a healthy job: rank 1 recovered, rank 0 not flagged.
        def healthy() -> bool:
            states = {r: st for r, (_, _, st) in h.service.scores(job).items()}
            return set(states) == {0, 1} and all(st == "healthy" for st in states.values())

        assert h.run_until(healthy, 60, job), (h.service.scores(job), h.events("straggler_detected", job))
        seen = len(h.events("straggler_detected", job))
        # 5% of a CPU: far below what rank 0 gets, so the quota binds.
        groups[0].quota(0.05)

        def rank0_detected() -> list[dict[str, Any]]:
            return [e for e in h.events("straggler_detected", job)[seen:] if e["rank"] == 0]

        assert h.run_until(lambda: bool(rank0_detected()), 60, job), \
            ("quota not detected", groups[0].throttled_s(), h.events("straggler_detected", job))
        ev = rank0_detected()[0]
        assert ev["cause"] == "cpu_quota", (ev, groups[0].throttled_s(), h.events("straggler_detected", job))
        assert ev["fields"]["details"]["cpu_quota_s_per_step"] > 0
    finally:
        for p in hogs:
            if p.poll() is None:
                p.kill()
                p.wait()
        h.agent.supervisor.stop(job, "test done", hard=True)
        for g in groups:
            g.remove()


@pytest.mark.usefixtures("cpu_priority")
def test_exclusion_shrinks_dp_4_to_3_and_keeps_the_global_batch(harness_factory: Callable[..., Harness]) -> None:
    """A rank that stays slow past exclude_after_s is excluded: the job restarts with dp 3 from its
    checkpoint, the global batch stays 8 (3 + 3 + 2: uneven shares, exact gradient), it finishes."""
    h = harness_factory(replace(FAST, include_run_delay=False, exclude_after_s=2.0))
    job = "exclude"
    h.submit(job, 4, trainer_spec(4, 220, ["slow:rank=3,factor=4,step=15"], batch=8))
    assert h.run_until(lambda: bool(h.events("rank_excluded", job)), 150, job), "no exclusion"
    ev = h.events("rank_excluded", job)[0]
    assert ev["rank"] == 3 and ev["fields"]["action"] == "exclude", ev
    rec = h.agent.supervisor.jobs[job]
    assert rec.spec.nproc == 3 and rec.spec.trainer["parallel"]["dp"] == 3
    assert rec.spec.trainer["global_batch"] == 8

    def shrunk_world_reports() -> bool:
        views = h.agent.table.snapshot().jobs.get(job, {})
        live = {r: v for r, v in views.items() if v.world_size == 3}
        return len(live) == 3 and sum(v.batch_size for v in live.values()) == 8

    assert h.run_until(shrunk_world_reports, 120, job), "the dp=3 job does not report a global batch of 8"
    assert h.run_until(lambda: h.agent.supervisor.jobs[job].state.finished, 240, job), "job did not finish"
    assert h.agent.supervisor.jobs[job].state.value == "succeeded", h.agent.supervisor.jobs[job].reason
