"""``trainguard run`` takes torchrun's launch flags, both spellings, and its ``PET_*`` environment
as their defaults (flags win); a bad value is one line and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.cli import build_parser
from trainguard.launch.torchrun_args import Launch, UsageError, resolve

REPO = Path(__file__).resolve().parents[2]


def launch(argv: list[str], environ: dict[str, str] | None = None, cwd: Path | None = None) -> Launch:
    args = build_parser().parse_args(["run", *argv])
    return resolve(args, environ or {}, cwd=str(cwd) if cwd else None)


@pytest.fixture()
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


@pytest.mark.parametrize("spelling", ["--nproc", "--nproc-per-node", "--nproc_per_node"])
def test_every_spelling_of_nproc(spelling: str, script: Path) -> None:
    got = launch([spelling, "3", str(script), "--lr", "0.1"])
    assert got.nproc == 3
    assert got.command == [sys.executable, "-u", str(script), "--lr", "0.1"]  # torchrun's `python -u`


@pytest.mark.parametrize(("argv", "attr", "want"), [
    (["--rdzv-id", "abc"], "job", "abc"),
    (["--rdzv_id", "abc"], "job", "abc"),
    (["--rdzv-id", "abc", "--job", "mine"], "job", "mine"),
    (["--max-restarts", "4"], "max_restarts", 4),
    (["--max_restarts", "0"], "max_restarts", 0),
    (["--standalone"], "standalone", True),
    (["--no-agent"], "no_agent", True),
    (["--nnodes", "1"], "nproc", 1),
    (["--nnodes", "1:4"], "nproc", 1),
    (["--node-rank", "0"], "nproc", 1),
    (["--node_rank", "0"], "nproc", 1),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29400"], "nproc", 1),
    (["--rdzv_backend", "static", "--rdzv_endpoint", "[::1]:0"], "nproc", 1),
])
def test_torchrun_flags(argv: list[str], attr: str, want: object, script: Path) -> None:
    assert getattr(launch([*argv, str(script)]), attr) == want


def test_master_addr_and_port_are_accepted_with_a_note(script: Path) -> None:
    for flags in (["--master-addr", "10.0.0.1", "--master-port", "29500"],
                  ["--master_addr", "10.0.0.1", "--master_port", "29500"]):
        got = launch([*flags, str(script)])
        assert len(got.notes) == 2 and "--master-port 29500: not used on one node" in got.notes[1]


def test_script_forms_as_torchrun_has_them(tmp_path: Path, script: Path) -> None:
    assert launch(["-m", "pkg.train", "--x"]).command == [sys.executable, "-u", "-m", "pkg.train", "--x"]
    assert launch(["--module", "pkg.train"]).command == [sys.executable, "-u", "-m", "pkg.train"]
    assert launch(["--run-path", str(script)]).command == [sys.executable, "-u", str(script)]
    assert launch(["--no-python", "bash", "-c", "true"]).command == ["bash", "-c", "true"]
    assert launch(["--no_python", "echo"]).command == ["echo"]
    # PYTHON_EXEC picks the interpreter, as in torchrun.
    assert launch([str(script)], {"PYTHON_EXEC": "/opt/py"}).command == ["/opt/py", "-u", str(script)]
    # A relative script is looked for where the ranks run.
    assert launch(["train.py", "a"], cwd=tmp_path).command == [sys.executable, "-u", "train.py", "a"]


def test_a_command_after_double_dash_runs_as_given(script: Path) -> None:
    got = launch(["--nproc", "2", "--", "python", str(script), "--lr", "1"])
    assert got.command == ["python", str(script), "--lr", "1"]


def test_script_args_that_look_like_our_flags_stay_the_scripts(script: Path) -> None:
    got = launch(["--nproc-per-node", "2", str(script), "--nproc", "5", "--standalone", "-m"])
    assert got.nproc == 2 and not got.standalone
    assert got.command[2:] == [str(script), "--nproc", "5", "--standalone", "-m"]


def test_pet_environment_gives_the_defaults(script: Path) -> None:
    env = {"PET_NPROC_PER_NODE": "4", "PET_NNODES": "1:2", "PET_NODE_RANK": "0", "PET_RDZV_BACKEND": "c10d",
           "PET_RDZV_ENDPOINT": "node0:29400", "PET_RDZV_ID": "slurm-77", "PET_MAX_RESTARTS": "2",
           "PET_STANDALONE": "1"}
    got = launch([str(script)], env)
    assert (got.nproc, got.job, got.max_restarts, got.standalone) == (4, "slurm-77", 2, True)
    with pytest.raises(UsageError, match="--no-python cannot be used with -m"):
        launch(["--no-python", "echo"], {"PET_MODULE": "1"})
    assert launch(["pkg.mod"], {"PET_MODULE": "1"}).command == [sys.executable, "-u", "-m", "pkg.mod"]
    assert launch(["echo"], {"PET_NO_PYTHON": "1"}).command == ["echo"]
    assert launch([str(script)], {"PET_STANDALONE": "0"}).standalone is False
    assert launch([str(script)], {"PET_RDZV_ID": "none"}).job is None  # torchrun's "no id"


def test_flags_win_over_pet_environment(script: Path) -> None:
    env = {"PET_NPROC_PER_NODE": "4", "PET_RDZV_ID": "from-env", "PET_MAX_RESTARTS": "2", "PET_NNODES": "3"}
    got = launch(["--nproc-per-node", "2", "--rdzv-id", "from-flag", "--max-restarts", "5", "--nnodes", "1",
                  str(script)], env)
    assert (got.nproc, got.job, got.max_restarts) == (2, "from-flag", 5)
    # A PET_* form of a script flag does not apply to -- CMD (only the flag itself is refused there).
    assert launch(["--", "echo", "x"], {"PET_MODULE": "1"}).command == ["echo", "x"]


def test_nproc_words(script: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    assert launch(["--nproc-per-node", "cpu", str(script)]).nproc == cpus
    assert launch([str(script)], {"PET_NPROC_PER_NODE": "cpu"}).nproc == cpus
    import torch

    expect = torch.accelerator.device_count() if torch.accelerator.is_available() else cpus
    assert launch(["--nproc-per-node", "auto", str(script)]).nproc == expect
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA GPU"):
            launch(["--nproc-per-node", "gpu", str(script)])
    else:
        assert launch(["--nproc-per-node", "gpu", str(script)]).nproc == torch.cuda.device_count()


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--nnodes", "2"], {}, "--nnodes 2: several nodes meet at a rendezvous: give --rdzv-endpoint"),
    (["--nnodes", "2:4", "--rdzv-endpoint", "n0:29400"], {}, "several nodes meet through --rdzv-backend c10d"),
    (["--nnodes", "2:4", "--rdzv-endpoint", "n0:29400", "--rdzv-backend", "c10d"], {}, "--rdzv-id: several nodes"),
    ([], {"PET_NNODES": "2"}, "PET_NNODES=2: several nodes"),
    (["--nnodes", "2", "--standalone"], {}, "--standalone runs one node"),
    (["--nnodes", "0"], {}, "--nnodes 0: must be >= 1"),
    (["--nnodes", "3:2"], {}, "MAX is below MIN"),
    (["--nnodes", "1:2:3"], {}, "expected MIN or MIN:MAX"),
    (["--nnodes", "x"], {}, "--nnodes x: not a whole number"),
    (["--node-rank", "1"], {}, "--node-rank 1: on one node"),
    (["--rdzv-backend", "etcd"], {}, "--rdzv-backend etcd: trainguard run supports c10d or static"),
    (["--rdzv-endpoint", ":29400"], {}, "expected HOST[:PORT]"),
    (["--rdzv-endpoint", "n0:http"], {}, "not a whole number"),
    (["--nproc-per-node", "0"], {}, "--nproc-per-node 0: must be >= 1"),
    (["--nproc", "many"], {}, "--nproc-per-node many: expected a number or one of gpu, cpu, auto"),
    ([], {"PET_NPROC_PER_NODE": "x"}, "PET_NPROC_PER_NODE=x: expected a number"),
    (["--max-restarts", "-1"], {}, "--max-restarts -1: must be >= 0"),
    (["--master-port", "70000"], {}, "--master-port 70000: must be between 1 and 65535"),
    ([], {"PET_STANDALONE": "maybe"}, "PET_STANDALONE='maybe': expected 1 or 0"),
    (["--rdzv-id", "a/b"], {}, "--rdzv-id a/b: a job id is 1-64 letters"),
    ([], {"PET_RDZV_ID": "x" * 65}, "PET_RDZV_ID=" + "x" * 65 + ": a job id"),
    (["--job", ".x"], {}, "--job .x: a job id"),
])
def test_bad_values_are_one_clear_error(argv: list[str], env: dict[str, str], message: str, script: Path) -> None:
    with pytest.raises(UsageError) as exc:
        launch([*argv, str(script)], env)
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize(("argv", "message"), [
    ([], "run needs a script or a command"),
    (["--"], "run needs a command after --"),
    (["-m", "--", "echo"], "take a SCRIPT, not -- CMD"),
    (["--no-python", "-m", "x"], "--no-python cannot be used with -m"),
    (["no_such_script.py"], "no_such_script.py: no such file (a command goes after --"),
])
def test_bad_command_lines(argv: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace("-", r"\-")):
        launch(argv, cwd=tmp_path)


def test_the_command_line_exits_2_with_one_line(tmp_path: Path) -> None:
    for argv, env in ((["--nnodes", "2", "x.py"], {}), (["--nproc-per-node", "zero", "x.py"], {}),
                      (["x.py"], {"PET_NODE_RANK": "3"}), (["missing.py"], {})):
        (tmp_path / "x.py").write_text("")
        res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--no-agent", *argv], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(REPO), **env})
        assert res.returncode == 2, (argv, res.stderr)
        assert res.stderr.startswith("trainguard: ") and res.stderr.count("\n") == 1, res.stderr
        assert res.stdout == ""


def test_help_lists_every_flag_with_help_a_metavar_and_the_torchrun_example() -> None:
    parser = build_parser()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    for action in run._actions:
        assert action.help, action.option_strings
        if action.nargs != 0:
            assert action.metavar, action.option_strings
    text = run.format_help()
    for flag in ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank", "--node_rank", "--rdzv-backend",
                 "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--max-restarts",
                 "--max_restarts", "--master-addr", "--master-port", "--standalone", "--run-path", "--module",
                 "--no-python", "--no-agent", "--state-dir"):
        assert flag in text, flag
    assert "torchrun --standalone --nproc-per-node 2 train.py --lr 0.1" in text
    assert "trainguard run --standalone --nproc-per-node 2 train.py --lr 0.1" in text


def test_run_finds_the_agent_through_trainguard_state_dir(tmp_path: Path) -> None:
    """No --state-dir: TRAINGUARD_STATE_DIR (what the ranks' API reads) names the agent looked for."""
    where = tmp_path / "agentless"
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--", "true"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(REPO), "TRAINGUARD_STATE_DIR": str(where)})
    assert res.returncode == 1 and str(where / "run" / "agent.sock") in res.stderr, res.stderr
    assert "--state-dir" in res.stderr and "--no-agent" in res.stderr and "Traceback" not in res.stderr


def test_standalone_without_an_agent_hosts_one_and_says_so(tmp_path: Path) -> None:
    """torchrun's --standalone where no node agent runs: the command hosts one (tests/hostedagent
    has the recovery through it, as a user without root)."""
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'], "
                      "sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k != "TRAINGUARD_STATE_DIR"}
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--standalone", "--nproc-per-node", "2",
                          "show.py", "--arg", "x"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**env, "PYTHONPATH": str(REPO), "XDG_RUNTIME_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    notes = [line for line in res.stderr.splitlines() if line.startswith("trainguard: ")]
    assert "no node agent here; hosting one for this job" in notes[0], res.stderr
    assert sorted(res.stdout.splitlines()) == ["[rank0]:0 2 ['--arg', 'x']", "[rank1]:1 2 ['--arg', 'x']"]


def test_the_agents_warm_launcher_takes_torchruns_unbuffered_python(tmp_path: Path) -> None:
    """``python -u SCRIPT`` and ``python -u -m MODULE`` (the commands above) start warm, as without -u."""
    from trainguard.agent.lifecycle.jobs import JobSpec
    from trainguard.agent.lifecycle.launcher import Launcher

    def warm(command: list[str]) -> tuple[str, list[str]] | None:
        return Launcher.warm_module(JobSpec("j", 1, command=command, cwd=str(tmp_path)), sys.executable)

    assert warm([sys.executable, "-u", "train.py", "a"]) == (f"path:{tmp_path / 'train.py'}", ["a"])
    assert warm([sys.executable, "-u", "-m", "pkg.mod", "b"]) == ("pkg.mod", ["b"])
    assert warm([sys.executable, "-u"]) is None and warm([sys.executable, "-u", "-c", "pass"]) is None


def test_torchrun_flags_without_effect_here_are_accepted_with_a_note(script: Path) -> None:
    got = launch(["--rdzv-conf", "timeout=900", "--rdzv_conf", "join_timeout=9", "--monitor-interval", "1",
                  "--start-method", "fork", "--role", "trainer", "--log-dir", "/tmp/x", "-r", "3", "--tee", "3",
                  "--local-ranks-filter", "0", "--local_addr", "n0", str(script)])
    assert got.nproc == 1 and len(got.notes) == 9, got.notes
    assert got.notes[0] == ("--rdzv-conf join_timeout=9: no effect here (rendezvous options apply to multi-node "
                            "rendezvous)")
    assert launch([str(script)], {"PET_RDZV_CONF": "timeout=1"}).notes == []


def test_detach_without_an_agent_is_refused(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "trainguard", "run", "--no-agent", "--detach", "--", "true"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and res.stderr.startswith("trainguard: --detach and --nodes need an agent"), res.stderr
    assert res.stderr.count("\n") == 1


def test_several_nodes_meet_at_the_c10d_endpoint_from_flags_or_pet(script: Path) -> None:
    flags = launch(["--nnodes", "1:3", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head",
                    "--rdzv-id", "j7", "--node-rank", "1", "--rdzv-conf", "last_call_timeout=3,is_host=1",
                    str(script)])
    pet = launch([str(script)], {"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "2", "PET_RDZV_BACKEND": "c10d",
                                 "PET_RDZV_ENDPOINT": "head", "PET_RDZV_ID": "j7", "PET_NODE_RANK": "1",
                                 "PET_RDZV_CONF": "last_call_timeout=3"})
    for got in (flags, pet):
        assert got.rdzv is not None and got.nproc == 2 and got.job == "j7"
        assert (got.rdzv.host, got.rdzv.port, got.rdzv.run_id) == ("head", 29400, "j7")
        assert (got.rdzv.min_nodes, got.rdzv.max_nodes, got.rdzv.node_rank) == (1, 3, 1)
        assert got.rdzv.conf == {"last_call_s": 3.0}
    assert launch(["--nnodes", "1:3", str(script)]).rdzv is None  # no endpoint: one node
