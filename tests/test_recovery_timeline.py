"""A recovery's timeline: where the time from a rank's death to the first resumed step went."""

from __future__ import annotations

from types import SimpleNamespace

from trainguard.agent.recovery.service import recovery_timeline


def _msg(**marks: float) -> SimpleNamespace:
    fields = {"proc_start": None, "group_ready": None, "restore_begin": None, "restore_end": None}
    return SimpleNamespace(**{**fields, **marks})


def test_every_phase_from_the_kernels_death_to_the_first_step_adds_up() -> None:
    window = [_msg(proc_start=10.30, group_ready=10.35, restore_begin=10.40, restore_end=10.43), _msg(proc_start=99.0)]
    timeline = recovery_timeline(10.02, 10.25, window, 10.50, died_at=10.0)
    assert timeline == {"detect_s": 0.02, "teardown_s": 0.23, "fork_s": 0.05, "rendezvous_s": 0.05, "setup_s": 0.05,
                        "restore_s": 0.03, "first_step_s": 0.07}
    assert abs(sum(timeline.values()) - (10.50 - 10.0)) < 1e-9


def test_phases_no_one_reported_are_left_out_and_their_time_goes_to_the_next() -> None:
    # No kernel word of the death (no eBPF): the clock starts at the supervisor's; a script whose
    # trainguard.init came before its process group: setup holds the rendezvous.
    window = [_msg(proc_start=10.30, restore_begin=10.40, restore_end=10.43)]
    timeline = recovery_timeline(10.02, 10.25, window, 10.50)
    assert timeline == {"teardown_s": 0.23, "fork_s": 0.05, "setup_s": 0.10, "restore_s": 0.03, "first_step_s": 0.07}
