"""The multi-node arm of the recovery benchmark: 2 nodes x 2 ranks as network namespaces, the same
script (examples/ddp_api.py), the same kills of one rank on the second node, launched by
``trainguard run`` with torchrun's flags under a node agent per node, and by torchrun itself (from
the peers' venv when there is one) with ``--max-restarts``.

Per failure: resume (SIGKILL -> the first step finished after the restart, from the script's
progress files), steps lost (steps done at the kill - the step the restart resumed at) and lost
time (resume + the lost steps at the run's median step). The script keeps no checkpoint of its own:
under torchrun a restart starts again from step 0, which is what a torchrun user without
checkpoints loses; trainguard's ranks resume from their snapshots.

For trainguard each kill's restart is also split into phases, from the launchers' phase files
(``TRAINGUARD_RDZV_PHASES``) and the node agents' events, on one wall clock (the nodes are network
namespaces of one machine): where the time between the kill and the first step goes.

    python bench/recovery.py --multinode [--quick]      (root: network namespaces)
    python bench/recovery_multinode.py --size smoke       (its smallest configuration)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's bench package

from bench.netns import PORT, REPO, Node, Nodes  # noqa: E402

SCRIPT = str(REPO / "examples" / "ddp_api.py")
NAN = float("nan")


@dataclass
class Kill:
    at_step: int
    """Steps rank 0 had finished when the rank was killed."""
    resumed_at: int = -1
    resume_s: float = NAN
    killed_wall: float = NAN
    """``time.time()`` of the kill: the phases' origin."""
    phases: list[tuple[str, float]] = field(default_factory=list)
    """Seconds after the kill at which each phase of the restart ended (trainguard only)."""

    @property
    def steps_lost(self) -> int:
        return self.at_step - self.resumed_at


@dataclass
class Arm:
    name: str
    kills: list[Kill] = field(default_factory=list)
    step_s: float = NAN
    ok: bool = False
    note: str = ""

    @property
    def resume_median(self) -> float:
        return statistics.median(k.resume_s for k in self.kills) if self.kills else NAN

    @property
    def steps_lost_mean(self) -> float:
        return statistics.mean(k.steps_lost for k in self.kills) if self.kills else NAN

    @property
    def lost_per_failure(self) -> float:
        if not self.kills:
            return NAN
        return statistics.mean(k.resume_s + k.steps_lost * self.step_s for k in self.kills)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _steps(progress: Path) -> int:
    text = _read(progress / "step").strip()
    return int(text) if text.isdigit() else 0


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _started(progress: Path) -> tuple[int, int] | None:
    parts = _read(progress / "started").split()
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else None


def _wait(pred, timeout: float, what: str, every: float = 0.005):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(what)


def _launch(kind: str, node: Node, first: Node, root: Path, progress: Path, steps: int, restarts: int,
            state: Path | None, peers: Path | None) -> subprocess.Popen[bytes]:
    train = [SCRIPT, "--steps", str(steps), "--step-sleep", "0.02", "--progress", str(progress)]
    rdzv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"{first.addr}:{PORT}", "--rdzv-id", f"bench-{kind}", "--max-restarts", str(restarts)]
    log = root / f"{kind}-{node.name}.log"
    if kind == "trainguard":
        assert state is not None
        return node.popen([sys.executable, "-m", "trainguard", "run", "--state-dir", str(state), *rdzv, *train], log,
                          {"TRAINGUARD_RDZV_PHASES": str(root / f"phases-{node.name}.jsonl")})
    python = str(peers / "bin" / "python") if peers is not None else sys.executable
    # FACTS-style workaround: torchrun's restarted gloo workers must not share the dead attempt's store.
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    return node.popen([python, "-m", "torch.distributed.run", *rdzv, "--monitor-interval", "0.1", *train], log, env)


def run_arm(kind: str, root: Path, steps: int, kill_steps: list[int], peers: Path | None) -> Arm:
    arm = Arm(kind)
    home = root / kind
    progress = home / "progress"
    progress.mkdir(parents=True)
    with Nodes(home, ["node-a", "node-b"]) as nodes:
        a, b = nodes["node-a"], nodes["node-b"]
        states = [a.start_agent(home), b.start_agent(home)] if kind == "trainguard" else [None, None]
        procs = [_launch(kind, n, a, home, progress, steps, len(kill_steps) + 1, s, peers)
                 for n, s in zip((a, b), states, strict=True)]
        # The step time from a healthy stretch: step 5 (past the first slow steps) to the first kill.
        warm = _wait(lambda: _steps(progress) >= 5 and (time.monotonic(), _steps(progress)), 300, "step 5")
        for target in kill_steps:
            _wait(lambda target=target: _steps(progress) >= target, 300, f"step {target}")
            pid = int(_read(progress / "rank2.pid") or 0)
            before = _started(progress)
            kill = Kill(_steps(progress))
            killed, kill.killed_wall = time.monotonic(), time.time()
            os.kill(pid, signal.SIGKILL)
            if not arm.kills:
                arm.step_s = (killed - warm[0]) / max(1, kill.at_step - warm[1])
            started = _wait(lambda before=before: (got := _started(progress)) != before and got, 120, "restart")
            kill.resumed_at = started[0]
            # The first step of the new attempt: a write to the step file after the new start (the
            # old attempt's count may hold any value).
            since = (progress / "started").stat().st_mtime_ns
            _wait(lambda since=since: _mtime(progress / "step") > since, 120, "first resumed step")
            kill.resume_s = time.monotonic() - killed
            arm.kills.append(kill)
        codes = [p.wait(timeout=600) for p in procs]
        if kind == "trainguard":
            for kill in arm.kills:
                kill.phases = phases(home, [n.name for n in (a, b)], states, kill.killed_wall)
        arm.ok = codes == [0, 0]
        if not arm.ok:
            arm.note = f"exit {codes}"
    return arm


def _jsonl(path: Path) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for line in _read(path).splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def phases(home: Path, names: list[str], states: list[Path | None], t0: float) -> list[tuple[str, float]]:
    """The restart after the kill at ``t0``, phase by phase: seconds after the kill at which the
    last node finished each phase (the nodes wait for each other, so the last one sets the pace),
    the killed node's detection first and the agents' first step last."""
    marks: dict[str, list[float]] = {}
    for name in names:
        after = [p for p in _jsonl(home / f"phases-{name}.jsonl") if float(p.get("seen") or 0) >= t0]
        for key in ("seen", "ended", "stopped", "joined", "agreed", "started"):
            if after and float(after[0].get(key) or 0) >= t0:
                marks.setdefault(key, []).append(float(after[0][key]) - t0)
    for state in states:
        firsts: dict[str, float] = {}
        for e in _jsonl(state / "events" / "events.jsonl") if state is not None else []:
            ts = float(e.get("ts") or 0)
            if ts >= t0 and e.get("kind") in ("job_restart_requested", "job_restart", "ranks_started", "job_resumed"):
                firsts.setdefault(e["kind"], ts)
        for kind, at in firsts.items():
            marks.setdefault(kind, []).append(at - t0)
    order = [("detected: the agent stopped the killed node's ranks", "job_restart_requested"),
             ("launchers saw the failure", "seen"), ("round ended in the store", "ended"),
             ("ranks held", "stopped"), ("next round closed", "joined"), ("snapshot step agreed", "agreed"),
             ("attempt handed to the agents", "started"), ("agents relaunch", "job_restart"),
             ("ranks forked", "ranks_started"), ("agents heard of the first step (job_resumed)", "job_resumed")]
    return [(label, max(marks[key])) for label, key in order if marks.get(key)]


SIZES = {"smoke": (25, [10]), "quick": (60, [20]), "full": (400, [100, 250])}
"""Steps and the steps after which rank 2 is killed, per size."""


def measure(size: str, peers: Path | None, work: Path | None = None) -> tuple[Arm, Arm]:
    steps, kills = SIZES[size]
    root = work or Path(tempfile.mkdtemp(prefix="tg-recovery-mn-"))
    return run_arm("trainguard", root, steps, kills, peers), run_arm("torchrun", root, steps, kills, peers)


def report(ours: Arm, theirs: Arm) -> str:
    for arm in (ours, theirs):
        for k in arm.kills:
            print(f"  {arm.name:<10} kill at step {k.at_step:>4}: resumed at step {k.resumed_at:>4}, "
                  f"first step done {k.resume_s:6.2f}s after the kill")
            last = 0.0
            for label, at in k.phases:  # the last node's time; a phase may end before the one above
                print(f"      {at:6.3f}s  (+{max(0.0, at - last):5.3f})  {label}")
                last = max(last, at)
    ratio = theirs.lost_per_failure / ours.lost_per_failure if ours.kills and theirs.kills else NAN
    return (f"RESULT multinode_resume_s={ours.resume_median:.2f} multinode_steps_lost={ours.steps_lost_mean:.2f} "
            f"multinode_torchrun_resume_s={theirs.resume_median:.2f} "
            f"multinode_torchrun_steps_lost={theirs.steps_lost_mean:.2f} multinode_lost_time_ratio={ratio:.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The multi-node arm of bench/recovery.py on its own.")
    ap.add_argument("--size", choices=sorted(SIZES), default="quick", help="steps and kills (default quick)")
    ap.add_argument("--peers-venv", metavar="DIR", help="torchrun from this venv (default: this interpreter's)")
    ap.add_argument("--work", metavar="DIR", help="root of the nodes' files (short: agents' unix sockets live below it)")
    args = ap.parse_args(argv)
    ours, theirs = measure(args.size, Path(args.peers_venv) if args.peers_venv else None,
                           Path(args.work) if args.work else None)
    for arm in (ours, theirs):
        if not arm.ok:
            print(f"{arm.name}: {arm.note}")
    print(report(ours, theirs))
    return 0 if ours.ok and theirs.ok else 1


if __name__ == "__main__":
    sys.exit(main())
