"""A recovery's timeline: where the time from a rank's death to the first resumed step went."""

from __future__ import annotations

from types import SimpleNamespace

from trainguard.agent.recovery.service import recovery_timeline


def _msg(**marks: float) -> SimpleNamespace:
    fields = {"proc_start": None, "init_at": None, "rdzv_begin": None, "group_ready": None, "restore_begin": None,
              "restore_end": None}
    return SimpleNamespace(**{**fields, **marks})


def test_every_phase_from_the_kernels_death_to_the_first_step_adds_up() -> None:
    window = [_msg(proc_start=10.30, init_at=10.31, rdzv_begin=10.33, group_ready=10.35, restore_begin=10.40,
                   restore_end=10.43), _msg(proc_start=99.0)]
    timeline = recovery_timeline(10.02, 10.25, window, 10.50, died_at=10.0)
    assert timeline == {"detect_s": 0.02, "teardown_s": 0.23, "fork_s": 0.05, "startup_s": 0.03, "rendezvous_s": 0.02,
                        "setup_s": 0.05, "restore_s": 0.03, "first_step_s": 0.07}
    assert abs(sum(timeline.values()) - (10.50 - 10.0)) < 1e-9


def test_a_script_whose_process_group_came_up_before_init_has_no_rendezvous_phase() -> None:
    # A Hugging Face Trainer brings its group up while it is built; trainguard.init comes later,
    # from the callback. Untimed, the rendezvous is part of the script's start-up, never the other way.
    window = [_msg(proc_start=10.30, init_at=13.80, restore_begin=13.85, restore_end=13.90)]
    timeline = recovery_timeline(10.02, 10.25, window, 14.0)
    assert timeline == {"teardown_s": 0.23, "fork_s": 0.05, "startup_s": 3.5, "setup_s": 0.05, "restore_s": 0.05,
                        "first_step_s": 0.1}


def test_phases_no_one_reported_are_left_out_and_their_time_goes_to_the_next() -> None:
    # No kernel word of the death (no eBPF): the clock starts at the supervisor's; a rank that told
    # neither its init nor its rendezvous: setup holds both.
    window = [_msg(proc_start=10.30, restore_begin=10.40, restore_end=10.43)]
    timeline = recovery_timeline(10.02, 10.25, window, 10.50)
    assert timeline == {"teardown_s": 0.23, "fork_s": 0.05, "setup_s": 0.10, "restore_s": 0.03, "first_step_s": 0.07}
