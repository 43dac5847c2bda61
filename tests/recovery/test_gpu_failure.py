"""A GPU that fails mid-job (fake NVML: XID 79, double-bit ECC, lost) takes the job down only
until it restarts without that GPU: dp shrinks by one, the global batch stays, later launches leave
the GPU out of CUDA_VISIBLE_DEVICES.

End to end with an in-process agent whose GPU collector reads a fake NVML (four GPUs, ranks mapped
to GPU ``local_rank`` as in a container that hides pids from NVML) and real trainer ranks (on the
CPU: the restart logic does not care what the ranks compute on).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.fakenvml import FakeGpu, FakeNvml
from tests.helpers.jobs import trainer_spec
from trainguard.agent.collectors.gpu.config import GpuCollectorConfig
from trainguard.agent.config import AgentConfig, apply_state_dir
from trainguard.agent.daemon import Agent
from trainguard.agent.heal.gpu_faults import GpuFaults, failure_reason
from trainguard.agent.lifecycle.jobs import JobSpec
from trainguard.agent.lifecycle.ranks import visible_gpus


def test_which_gpu_events_mean_the_gpu_is_unusable() -> None:
    assert failure_reason("gpu_lost", {"gpu": 0, "detail": "stopped answering"}) == "GPU lost (stopped answering)"
    assert failure_reason("gpu_xid", {"gpu": 0, "xid": 79, "fatal": True}) == "fatal XID 79"
    assert failure_reason("gpu_xid", {"gpu": 0, "xid": 94, "fatal": True}) is None  # contained: app restart only
    assert failure_reason("gpu_xid", {"gpu": 0, "xid": 13, "fatal": False}) is None
    assert failure_reason("gpu_ecc", {"gpu": 0, "type": "double_bit"}) == "double-bit ECC error"
    assert failure_reason("gpu_ecc", {"gpu": 0, "type": "single_bit"}) is None


def test_visible_gpus_leave_failed_ones_out_in_the_jobs_own_order() -> None:
    assert visible_gpus(None, "3,1") is None  # nothing failed: the environment's choice stands
    assert visible_gpus((0, 2, 3), None) == (0, 2, 3)
    assert visible_gpus((0, 2, 3), "3,1,0") == (3, 0)
    assert visible_gpus((0, 2, 3), "GPU-aaaa") == (0, 2, 3)


def test_bad_event_fields_are_dropped_not_raised() -> None:
    faults = GpuFaults(None, None, None)  # type: ignore[arg-type]  # on_event and healthy use none of them
    assert not faults.on_event("gpu_xid", {"gpu": "1", "xid": 79})
    assert not faults.on_event("gpu_xid", {"gpu": True, "xid": 79})
    assert not faults.on_event("oom_kill", {"gpu": 1})
    assert faults.healthy([0, 1]) is None


class _Node:
    def __init__(self, tmp: Path, nvml: FakeNvml, warm: bool) -> None:
        cfg = apply_state_dir(AgentConfig(), str(tmp))
        cfg.recovery.warm_launcher = warm
        cfg.metrics.addr = "127.0.0.1:0"
        cfg.collectors.ebpf = False
        cfg.detection = type(cfg.detection)(enabled=False)
        cfg.gpu = GpuCollectorConfig(local_rank_fallback=True, event_wait_ms=50)
        self.agent = Agent(cfg, nvml_module=nvml)
        self.agent.start()

    def events(self, kind: str) -> list[dict[str, Any]]:
        return self.agent.events.since(0, 100000, kind)

    def run_until(self, cond: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.agent.tick(time.time())
            if cond():
                return True
            time.sleep(0.25)
        return False


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["xid79", "double_bit_ecc"])
def test_a_failed_gpu_restarts_the_job_without_it(tmp_path: Path, fault: str) -> None:
    nvml = FakeNvml([FakeGpu(index=i) for i in range(4)])
    # Cold launches for one case: a rank forked by the warm launcher shows the zygote's environment
    # in /proc/<pid>/environ, not the one it runs with.
    cold = fault == "xid79"
    node = _Node(tmp_path, nvml, warm=not cold)
    job = "gpujob"
    try:
        node.agent.supervisor.submit(JobSpec.from_dict({"job": job, "nproc": 4, "trainer": trainer_spec(4, 120, batch=8)}))

        def step() -> int:
            views = node.agent.table.snapshot().jobs.get(job, {})
            return min((v.step for v in views.values()), default=-1) if len(views) == 4 else -1

        assert node.run_until(lambda: step() >= 25, 120), "job did not train"
        pushed = nvml.push_xid(1, 79) if fault == "xid79" else nvml.push_ecc(1, double_bit=True)
        assert pushed, "the collector's event thread did not register for GPU events"
        assert node.run_until(lambda: bool(node.events("rank_excluded")), 30), node.events("gpu_xid")
        [failed] = node.events("gpu_failed")
        assert failed["fields"]["gpu"] == 1 and failed["fields"]["jobs"] == [job], failed
        [excluded] = node.events("rank_excluded")
        assert excluded["job"] == job and excluded["rank"] == 1 and "GPU 1" in excluded["cause"], excluded
        rec = node.agent.supervisor.jobs[job]
        assert rec.spec.nproc == 3 and rec.spec.trainer["global_batch"] == 8

        def relaunched_without_gpu_1() -> bool:
            ranks = node.agent.supervisor.jobs[job].ranks
            return len(ranks) == 3 and all(r.alive for r in ranks)

        assert node.run_until(relaunched_without_gpu_1, 60), "not relaunched with 3 ranks"
        ranks = node.agent.supervisor.jobs[job].ranks
        assert [r.gpu for r in ranks] == [0, 2, 3]
        if cold:
            def rank0_environ() -> list[bytes]:
                # Empty while the rank is between fork and exec (or already a zombie): read the
                # rank 0 the supervisor runs now, until its environment is there.
                try:
                    return Path(f"/proc/{node.agent.supervisor.jobs[job].ranks[0].pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    return []

            assert node.run_until(lambda: rank0_environ() != [b""] and rank0_environ() != [], 20), "no environment"
            assert b"CUDA_VISIBLE_DEVICES=0,2,3" in rank0_environ()
        # The collector attributes the new ranks to the GPUs they were given.
        tracked = node.agent.supervisor.tracked()
        assert sorted(p.gpu for p in tracked.values()) == [0, 2, 3]

        def shrunk_world_reports() -> bool:
            views = node.agent.table.snapshot().jobs.get(job, {})
            live = [v for v in views.values() if v.world_size == 3]
            return len(live) == 3 and sum(v.batch_size for v in live) == 8

        assert node.run_until(shrunk_world_reports, 90), "the dp=3 job does not report a global batch of 8"
        assert node.run_until(lambda: node.agent.supervisor.jobs[job].state.finished, 240), "job did not finish"
        assert node.agent.supervisor.jobs[job].state.value == "succeeded", node.agent.supervisor.jobs[job].reason
        assert len(node.events("gpu_failed")) == 1  # one GPU, one failure event
    finally:
        node.agent.shutdown()
