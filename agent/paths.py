"""Where an agent keeps its files and sockets; ``--state-dir`` moves all of them under one folder."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass

from trainguard.agent.config import DEFAULT_RUN_DIR, DEFAULT_STATE_DIR
from trainguard.agent.safefs import DirCheck, ensure_agent_dir


def agent_tag(state_dir: str) -> str:
    """A short name of this agent on its host, from its state dir: agents side by side (tests,
    simulated nodes) never share a memory tier or a cgroup."""
    return hashlib.sha1(os.path.abspath(state_dir).encode()).hexdigest()[:10]


@dataclass(frozen=True)
class AgentPaths:
    state_dir: str
    run_dir: str

    @classmethod
    def for_state_dir(cls, state_dir: str | None) -> AgentPaths:
        if state_dir:
            return cls(state_dir, os.path.join(state_dir, "run"))
        return cls(DEFAULT_STATE_DIR, DEFAULT_RUN_DIR)

    @property
    def control_socket(self) -> str:
        return os.path.join(self.run_dir, "agent.sock")

    @property
    def telemetry_socket(self) -> str:
        return os.path.join(self.run_dir, "telemetry.sock")

    @property
    def plans_dir(self) -> str:
        return os.path.join(self.run_dir, "plans")

    @property
    def events_dir(self) -> str:
        return os.path.join(self.state_dir, "events")

    @property
    def jobs_dir(self) -> str:
        return os.path.join(self.state_dir, "jobs")

    @property
    def checkpoints_dir(self) -> str:
        return os.path.join(self.state_dir, "checkpoints")

    @property
    def discovery_file(self) -> str:
        """Where ranks the agent did not start find it (``trainguard.run.environment``)."""
        return os.path.join(self.run_dir, "agent.json")

    @property
    def pid_file(self) -> str:
        return os.path.join(self.run_dir, "agent.pid")

    @property
    def metrics_addr_file(self) -> str:
        """The bound metrics address, so clients and tests find an agent started on port 0."""
        return os.path.join(self.run_dir, "metrics.addr")

    def ensure(self, *, ranks_traverse: bool = False) -> list[DirCheck]:
        """Create the agent's directories, or check the ones there: each a real directory (not a
        symlink) of the agent's own uid that no group or other may write (a loose mode on its own
        directory is tightened). One another identity owns is refused (UnsafeTreeError, an
        OSError): it holds the event log, job records and the disk tier, so it is never moved.

        ``ranks_traverse`` (ranks run as ``launcher.user``): the directories on the way to the
        telemetry socket and the plan files get 0751, so a rank of another uid reaches the names it
        is given while listing them stays refused; without it the run and plans dirs are 0750 again
        (the state dir is then left as its owner made it)."""
        checks = [ensure_agent_dir(d, mode=0o750, takeover=False)
                  for d in (self.state_dir, self.run_dir, self.plans_dir, self.events_dir, self.jobs_dir)]
        for d in self.rank_path_dirs():
            if not ranks_traverse and d == self.state_dir:
                continue
            mode = stat.S_IMODE(os.lstat(d).st_mode)
            # Only the "other" bits change: the owner's and the group's stay as the operator set them.
            want = (mode & ~0o007) | (0o001 if ranks_traverse else 0)
            if mode != want:
                os.chmod(d, want, follow_symlinks=False)
        return checks

    def rank_path_dirs(self) -> list[str]:
        """The agent's directories a rank crosses to its telemetry socket and plan file: the run
        dir, the plans dir, and the state dir when the run dir lies inside it (``--state-dir``)."""
        dirs = [self.run_dir, self.plans_dir]
        state = os.path.abspath(self.state_dir)
        if os.path.abspath(self.run_dir).startswith(state + os.sep):
            dirs.insert(0, self.state_dir)
        return dirs
