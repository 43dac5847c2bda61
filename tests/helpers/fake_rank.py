"""A stand-in rank for launcher/supervisor tests: sends telemetry like the trainer, no torch.

Behaviour from env: FAKE_STEPS (steps to run), FAKE_STEP_S (seconds per step), FAKE_EXIT_AT
("rank:step:code" -> exit with code at step; code "kill" -> SIGKILL self).
"""

from __future__ import annotations

import os
import signal
import sys
import time

from trainguard.agent.wire import Telemetry
from trainguard.run.link import PlanWatcher, TelemetrySender


def main() -> int:
    rank = int(os.environ["RANK"])
    steps = int(os.environ.get("FAKE_STEPS", "20"))
    step_s = float(os.environ.get("FAKE_STEP_S", "0.02"))
    exit_at = os.environ.get("FAKE_EXIT_AT", "")
    attempt = int(os.environ.get("TRAINGUARD_ATTEMPT", "1"))
    sender = TelemetrySender.from_env()
    plans = PlanWatcher.from_env()
    job = os.environ.get("TRAINGUARD_JOB", "fake")
    print(f"rank {rank} attempt {attempt} caps={open('/proc/self/status').read().split('CapEff:')[1].split()[0]}", flush=True)
    for step in range(steps):
        t0 = time.time()
        time.sleep(step_s)
        if exit_at and (attempt == 1 or os.environ.get("FAKE_EXIT_ALWAYS")):
            r, s, code = exit_at.split(":")
            if int(r) == rank and int(s) == step:
                if code == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                return int(code)
        plan = plans.poll()
        sender.send(
            Telemetry(
                job=job, rank=rank, local_rank=rank, pid=os.getpid(), step=step, wall_time=time.time(),
                step_s=time.time() - t0, data_s=0.001, fwd_bwd_s=step_s * 0.7, comm_s=step_s * 0.2, opt_s=step_s * 0.1,
                samples=8, tokens=256, loss=2.0 / (step + 1), grad_norm=1.0, local_grad_sq=1.0, lr=1e-3 * plan.lr_scale,
                batch_size=8, mem_bytes=1 << 20, plan_version=plan.version,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
