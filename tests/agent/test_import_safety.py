"""trainguard neither shadows nor is shadowed by a user's own ``agent.py``, ``trainer.py`` and
``tui.py``: the repository's parts live only under ``trainguard.*``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

USER_SCRIPT = """\
import os, sys
import agent, trainer, tui
import trainguard
import trainguard.agent.wire, trainguard.trainer.config, trainguard.tui
assert agent.MINE == "agent" and trainer.MINE == "trainer" and tui.MINE == "tui", "shadowed"
assert trainguard.agent.wire.__name__ == "trainguard.agent.wire"
run = trainguard.init()
with run.step(0, samples=1) as s:
    s.report(loss=1.0)
print("own files ok", os.environ.get("RANK"), flush=True)
"""


def user_project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in ("agent", "trainer", "tui"):
        (root / f"{name}.py").write_text(f'MINE = "{name}"\n')
    (root / "train.py").write_text(USER_SCRIPT)
    return root


def _env() -> dict[str, str]:
    # No PYTHONPATH: the installed package alone, as a user has it.
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_installed_names_are_only_trainguard() -> None:
    res = subprocess.run([sys.executable, "-c",
                          "import importlib.util as u, sys; sys.path.remove('') if '' in sys.path else None; "
                          "print([n for n in ('agent', 'trainer', 'tui') if u.find_spec(n) is not None])"],
                         cwd="/", capture_output=True, text=True, env=_env(), check=True)
    assert res.stdout.strip() == "[]", res.stdout


def test_each_file_has_one_path() -> None:
    """agent/, trainer/ and tui/ are installed as trainguard.agent, .trainer and .tui by the package
    map (setup.py), not reached through links: tracebacks, docs and editors name one path."""
    links = [str(p) for p in REPO.glob("trainguard/**/*") if p.is_symlink()]
    assert links == []
    code = "import trainguard.agent.daemon as d, trainguard.trainer.config as c, trainguard.tui as t; print(d.__file__, c.__file__, t.__file__)"
    res = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, env=_env(), check=True)
    assert res.stdout.split() == [str(REPO / "agent" / "daemon.py"), str(REPO / "trainer" / "config.py"),
                                  str(REPO / "tui" / "__init__.py")]


def test_a_checkout_that_is_not_installed_imports_from_pythonpath_alone() -> None:
    """``PYTHONPATH=<checkout>`` with no site packages (so no editable install): the checkout's
    folders are trainguard's parts all the same (``trainguard.checkout``)."""
    code = "import trainguard.agent.wire as w, trainguard.tui as t; print(w.__file__, t.__file__)"
    res = subprocess.run([sys.executable, "-S", "-c", code], cwd="/", capture_output=True, text=True,
                         env={**_env(), "PYTHONPATH": str(REPO)}, check=True)
    assert res.stdout.split() == [str(REPO / "agent" / "wire.py"), str(REPO / "tui" / "__init__.py")]


def test_importing_trainguard_loads_no_bare_names_and_no_torch() -> None:
    code = ("import sys, trainguard, trainguard.agent.daemon, trainguard.cli; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('agent', 'trainer', 'tui')]; "
            "print(bad, 'torch' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, env=_env(), check=True)
    assert res.stdout.strip() == "[] False", res.stdout


def test_the_cli_loads_only_what_a_client_needs() -> None:
    """`trainguard status` answers in a blink: the CLI module pulls in no etcd, HTTP-library,
    Prometheus, object-store or torch code (the agent's own modules load them when it runs)."""
    code = ("import sys, trainguard.cli; heavy = ('etcd3gw', 'requests', 'prometheus_client', 'fsspec', 'torch', "
            "'numpy'); print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))")
    res = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, env=_env(), check=True)
    assert res.stdout.strip() == "[]", res.stdout


def test_a_user_script_next_to_its_own_agent_and_trainer_files(tmp_path: Path) -> None:
    project = user_project(tmp_path / "proj")
    res = subprocess.run([sys.executable, "train.py"], cwd=project, capture_output=True, text=True, env=_env())
    assert res.returncode == 0 and "own files ok" in res.stdout, res.stderr
    # The command line and the warm launcher's entry points work from inside such a directory.
    cli = subprocess.run([sys.executable, "-m", "trainguard", "agent", "--check-config", "/dev/null"], cwd=project,
                         capture_output=True, text=True, env=_env())
    assert cli.returncode == 0, cli.stderr
    st = subprocess.run([sys.executable, "-m", "trainguard", "run", "--no-agent", "--nproc", "2", "--",
                         sys.executable, "train.py"], cwd=project, capture_output=True, text=True, env=_env(), timeout=120)
    assert st.returncode == 0, st.stderr
    assert "[rank0]:own files ok 0" in st.stdout and "[rank1]:own files ok 1" in st.stdout


@pytest.mark.slow
def test_jobs_started_by_the_agent_from_such_a_directory(agent_factory: Any, tmp_path: Path) -> None:
    """Warm (forked) and cold ranks of an agent's job, started from the user's directory."""
    project = user_project(tmp_path / "proj")
    agent = agent_factory(config="[collectors]\ngpu = false\n")
    for form in (["train.py"], ["-c", "import runpy; runpy.run_path('train.py', run_name='__main__')"]):
        res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--state-dir", str(agent.state_dir),
                              "--nproc", "2", "--", sys.executable, *form], cwd=project, capture_output=True,
                             text=True, env=_env(), timeout=180)
        assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-2000:])
        assert "[rank0]:own files ok 0" in res.stdout and "[rank1]:own files ok 1" in res.stdout
    # The embedded trainer still runs from there (its ranks are trainguard.trainer.worker).
    tr = subprocess.run([sys.executable, "-m", "trainguard", "train", "--standalone", "--nproc", "1", "--steps", "2",
                         "--set", "model.layers=1", "--set", "model.d_model=32", "--set", "model.context=32",
                         "--set", "data.max_bytes=2000000", "--set", f"data.cache_dir={tmp_path / 'corpus'}"],
                        cwd=project, capture_output=True, text=True, env=_env(), timeout=180)
    assert tr.returncode == 0, tr.stderr[-2000:]
