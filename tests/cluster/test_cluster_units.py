"""Pure parts of the cluster layer: job moves after a node loss, dp shrinking, rank placement,
config loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.cluster.jobs import JobRecordDoc, plan_moves, shrink_spec
from trainguard.agent.cluster.placement import NodeBlock, Placement, PlacementError, place


def spec(nproc: int, dp: int, tp: int = 1, pp: int = 1) -> dict:
    return {"job": "j", "nproc": nproc, "trainer": {"parallel": {"dp": dp, "tp": tp, "pp": pp}}}


def test_shrink_keeps_model_replicas_whole() -> None:
    new, why = shrink_spec(spec(8, 4, tp=2), 5)
    assert new["nproc"] == 4 and new["trainer"]["parallel"] == {"dp": 2, "tp": 2, "pp": 1}
    assert why == "dp 4 -> 2 to fit 5 slots"
    same, why = shrink_spec(spec(4, 4), 8)
    assert same == spec(4, 4) and why == ""
    same, why = shrink_spec(spec(4, 1, tp=4), 2)  # one replica does not fit: unchanged, launch fails loudly
    assert same["nproc"] == 4 and why == ""
    assert shrink_spec(spec(4, 4), 0)[0]["nproc"] == 4  # unknown slots: trust the spec


def rec(job: str, node: str, peer: str = "", state: str = "running", epoch: int = 0) -> JobRecordDoc:
    return JobRecordDoc(job, spec(2, 2), node, peer, state, epoch)


def test_plan_moves_prefers_the_lost_nodes_peer_and_skips_live_or_finished_jobs() -> None:
    records = {
        "onpeer": (rec("onpeer", "a", peer="c"), 11),
        "ring": (rec("ring", "b", peer="gone"), 12),
        "alive": (rec("alive", "c"), 13),
        "done": (rec("done", "a", state="finished"), 14),
        "wrap": (rec("wrap", "z"), 15),
    }
    moves = {m.job: (new, rev, m) for new, rev, m in plan_moves(records, {"c": 2, "d": 1})}
    assert set(moves) == {"onpeer", "ring", "wrap"}
    new, rev, m = moves["onpeer"]
    assert (m.src, m.dst, m.epoch, rev) == ("a", "c", 1, 11) and new.node == "c" and new.history == ["a->c"]
    assert moves["ring"][2].dst == "c"  # next member after "b" by name
    assert moves["wrap"][2].dst == "c"  # after the last name: wrap to the first
    with_plan = JobRecordDoc("x", spec(2, 2), "a", "d", plan={"lr_scale": 0.5, "batch_sizes": [4, 4]})
    new_small, _, m_small = plan_moves({"x": (with_plan, 1)}, {"d": 1})[0]
    assert m_small.reason == "dp 2 -> 1 to fit 1 slots"
    assert new_small.plan == {"lr_scale": 0.5}  # the per-dp-rank split is dropped with the dp change
    new_same, _, _ = plan_moves({"x": (with_plan, 1)}, {"d": 2})[0]
    assert new_same.plan == with_plan.plan
    assert plan_moves(records, {}) == []


def test_a_drained_owner_is_moved_off_although_alive_and_not_to_another_drained_node() -> None:
    drained = JobRecordDoc("x", spec(2, 2), "a", "b", drained=["a", "b"])
    [(new, _, m)] = plan_moves({"x": (drained, 4)}, {"a": 2, "b": 2, "c": 2})
    assert (m.src, m.dst) == ("a", "c") and new.cause == "node a drained" and new.drained == ["a", "b"]
    assert plan_moves({"x": (new, 5)}, {"a": 2, "b": 2, "c": 2}) == []  # settled on c
    assert plan_moves({"x": (drained, 4)}, {"a": 2, "b": 2}) == []  # nowhere else to go: it stays


def test_record_json_round_trip_and_garbage() -> None:
    r = rec("j", "a", "b", epoch=3)
    assert JobRecordDoc.from_json(r.to_json()) == r
    d = JobRecordDoc("j", spec(2, 2), "a", drained=["b"])
    assert JobRecordDoc.from_json(d.to_json()) == d
    assert JobRecordDoc.from_json(b"not json") is None
    assert JobRecordDoc.from_json(b'{"job": "j"}') is None


def test_placement_keeps_tp_groups_inside_nodes() -> None:
    p = place(dp=3, tp=2, pp=1, slots={"n1": 3, "n2": 4})
    assert [(b.node, b.rank_offset, b.nproc) for b in p.blocks] == [("n1", 0, 2), ("n2", 2, 4)]
    assert any("idle" in n for n in p.notes) and p.check() == []
    env = p.rank_env("n2", 1, "10.0.0.1", 29500)
    assert env["RANK"] == "3" and env["WORLD_SIZE"] == "6" and env["LOCAL_WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "10.0.0.1" and p.master_node == "n1"
    assert "n1: ranks 0-1" in p.describe()
    with pytest.raises(PlacementError, match="need more room"):
        place(dp=4, tp=2, pp=1, slots={"n1": 3, "n2": 3})
    with pytest.raises(PlacementError):
        p.rank_env("n1", 5, "h", 1)
    split = Placement(2, 2, 1, (NodeBlock("a", 0, 1), NodeBlock("b", 1, 3)))
    assert split.check() and "spans" in split.check()[0]
    skipped = place(dp=1, tp=4, pp=1, slots={"small": 2, "big": 4})
    assert [b.node for b in skipped.blocks] == ["big"] and any("skipped" in n for n in skipped.notes)


def test_cluster_config_section(tmp_path: Path) -> None:
    """The daemon's own config file carries [cluster]; errors name the key."""
    from trainguard.agent.cluster.signing import write_key
    from trainguard.agent.config import ConfigError, load_config

    path = tmp_path / "agent.toml"
    key = write_key(str(tmp_path / "cluster.key"))
    path.write_text('[cluster]\nname = "prod"\netcd_endpoints = ["127.0.0.1:2379"]\nlease_ttl_s = 6\nrejoin = false\n'
                    f'etcd_plaintext = true\nkey_file = "{key}"\n')
    cfg = load_config(str(path), must_exist=True).cluster
    assert cfg.name == "prod" and cfg.lease_ttl_s == 6 and not cfg.solo and cfg.rejoin is False
    for body, error in (('leese_ttl_s = 6', r"^cluster\.leese_ttl_s: unknown key"),
                        ('lease_ttl_s = "6"', r"^cluster\.lease_ttl_s: expected an integer"),
                        ('etcd_endpoints = ["127.0.0.1:2379"]\nlease_ttl_s = 3\netcd_timeout_s = 2.0',
                         r"^cluster\.etcd_timeout_s"),
                        ('rejoin = "yes"', r"^cluster\.rejoin")):
        path.write_text(f"[cluster]\n{body}\n")
        with pytest.raises(ConfigError, match=error):
            load_config(str(path), must_exist=True)
