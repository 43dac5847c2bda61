"""A spanning job's checkpoint parts: which node holds which part of which step (the survey the
leader's restore decision reads), and every part of a step fetched, verified and merged into one
local directory before a restore (``GangCoordinator`` inherits these)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.agent.checkpoint.errors import CheckpointError
from trainguard.agent.checkpoint.manifest import MANIFEST_NAME, Manifest, read_manifest
from trainguard.agent.checkpoint.objectstore import ObjectTier
from trainguard.agent.checkpoint.tier import Tier, step_dirname
from trainguard.agent.cluster.blobstore import CKPT_NS, INDEX, BlobStore
from trainguard.agent.cluster.decision import Gang
from trainguard.agent.cluster.jobs import JobRecordDoc, valid_node_name
from trainguard.agent.cluster.peertier import ClientFactory, PeerRef, fetch_remote_copy
from trainguard.agent.cluster.survey import TIER_HOLDER, Survey, take_survey
from trainguard.agent.safefs import (
    copy_tree_beneath,
    dir_fd,
    ensure_agent_dir,
    rename_beneath,
    rmtree_beneath,
    walk_files,
)
from trainguard.agent.wire import part_key, valid_job_id

if TYPE_CHECKING:
    from trainguard.agent.cluster.membership import EmitFn, NodeInfo


class GangParts:
    """The checkpoint half of ``GangCoordinator``: the attributes below are set by its constructor."""

    node: str
    store: BlobStore
    client_for: ClientFactory
    quick_client_for: ClientFactory
    scratch: Path
    cluster_key: bytes
    emit: EmitFn
    members: Callable[[], dict[str, NodeInfo]]
    decision_timeout_s: float
    shared_tiers: list[Tier]

    def _shared(self, holder: str) -> Tier:
        name = holder[len(TIER_HOLDER):]
        for tier in self.shared_tiers:
            if tier.name == name:
                return tier
        raise CheckpointError(f"no shared tier {name!r} here")

    def _index(self, holder: str, api: str, origin: str, key: str) -> list[int]:
        if holder.startswith(TIER_HOLDER):
            return [i.step for i in self._shared(holder).list(key)]
        if holder == self.node:
            return [i.step for i in self.store.held(origin).list(key)]
        raw = self.quick_client_for(PeerRef(holder, api)).get_blob(CKPT_NS, f"{origin}/{key}/{INDEX}")
        return [int(r["step"]) for r in json.loads(raw)]

    def _parts_of(self, holder: str, api: str, origin: str, key: str, step: int) -> tuple[list[str], float]:
        """(parts, commit time) from the manifest of ``origin``'s part of ``step`` at ``holder``."""
        shared = self._shared(holder) if holder.startswith(TIER_HOLDER) else None
        if isinstance(shared, ObjectTier):
            manifest = shared._read_manifest(key, step)  # the manifest alone, not the whole step
        elif shared is not None:
            probe = self.scratch / ".probe" / f"{key}-{step}"
            ensure_agent_dir(self.scratch)
            rmtree_beneath(self.scratch, probe)
            try:
                manifest = read_manifest(shared.fetch(key, step, probe))
            finally:
                rmtree_beneath(self.scratch, probe)
        elif holder == self.node:
            manifest = read_manifest(self.store.held(origin).step_path(key, step))
        else:
            raw = self.quick_client_for(PeerRef(holder, api)).get_blob(
                CKPT_NS, f"{origin}/{key}/{step_dirname(step)}/{MANIFEST_NAME}")
            manifest = Manifest.from_json(raw)
        parts = manifest.extra.get("parts")
        if not isinstance(parts, list):
            return [origin], manifest.created
        if not all(valid_node_name(p) for p in parts):  # part names become paths in assemble
            raise CheckpointError(f"manifest of {key} step {step} on {holder} lists parts that are not node names")
        return [str(p) for p in parts], manifest.created

    def survey(self, rec: JobRecordDoc, g: Gang, apis: dict[str, str], probe: Iterable[str] = ()) -> Survey:
        """Probe ``probe`` nodes' APIs and list every part of the job at every holder (members in
        ``apis`` and the shared tiers), all at once under ``decision_timeout_s``."""
        holders = {**apis, **{TIER_HOLDER + t.name: "" for t in self.shared_tiers}}

        def ping(node: str) -> None:
            self.quick_client_for(PeerRef(node, apis[node])).status()

        return take_survey(
            probe_nodes=[n for n in probe if n != self.node and n in apis], holders=list(holders),
            origins=list(g.nodes_seen), probe=ping,
            listing=lambda h, o: self._index(h, holders[h], o, part_key(rec.job, o)),
            parts_of=lambda h, o, step: self._parts_of(h, holders[h], o, part_key(rec.job, o), step),
            timeout_s=self.decision_timeout_s)

    def find_restore(self, rec: JobRecordDoc, g: Gang, apis: dict[str, str],
                     max_step: int | None) -> tuple[int, dict[str, list[str]]]:
        """Newest step (<= ``max_step``) of which every part is held by a node that answers."""
        return self.survey(rec, g, apis).find_restore(max_step, g.abandoned)

    def assemble(self, job: str, step: int, sources: dict[str, list[str]]) -> tuple[Path, dict[str, str]]:
        """Every part of ``step`` into one local directory (verified); returns (path, part -> holder).

        The scratch tree is the agent's; every delete, copy and move in it goes through directory
        fds without following a symlink (``agent.safefs``), whatever a rank or peer left there."""
        if not valid_job_id(job):
            raise CheckpointError(f"job id {job[:80]!r} is not a valid name")
        ensure_agent_dir(self.scratch)
        top = self.scratch / job
        dest = top / step_dirname(step)
        rmtree_beneath(self.scratch, top)
        staging = top / ".parts"
        with dir_fd(self.scratch, staging, create=True):
            pass
        apis = {n: i.api for n, i in self.members().items()}
        used: dict[str, str] = {}
        for part, holders in sorted(sources.items()):
            if not valid_node_name(part):
                raise CheckpointError(f"part {part[:80]!r} is not a node name")
            key = part_key(job, part)
            problems = []
            for holder in holders:
                target = staging / part
                try:
                    if holder.startswith(TIER_HOLDER):
                        self._shared(holder).fetch(key, step, target)
                    elif holder == self.node:
                        held = self.store.held(part)
                        result = held.verify(key, step)
                        if not result.ok:
                            raise CheckpointError(f"local copy corrupt: {result.error}")
                        copy_tree_beneath(held.root, held.step_path(key, step), self.scratch, target)
                    elif holder in apis:
                        fetch_remote_copy(self.client_for(PeerRef(holder, apis[holder])), holder, part, key, step,
                                          target, key=self.cluster_key, label=f"part {part}")
                    else:
                        raise CheckpointError(f"{holder} is not a member any more")
                except (CheckpointError, OSError) as exc:
                    problems.append(f"{holder}: {exc}")
                    rmtree_beneath(self.scratch, target)
                    self.emit("checkpoint_part_unusable", f"job {job} step {step}: part {part} from {holder} "
                              f"unusable ({exc}); trying the next holder",
                              {"job": job, "step": step, "part": part, "holder": holder, "severity": "warning"})
                    continue
                used[part] = holder
                break
            if part not in used:
                raise CheckpointError(f"no usable copy of part {part}: " + "; ".join(problems or ["no holder"]))
        with dir_fd(self.scratch, dest, create=True):
            pass
        for part in used:
            root = staging / part
            for rel, _ in walk_files(self.scratch, root):
                if rel == MANIFEST_NAME:
                    continue
                out = dest / rel
                with dir_fd(self.scratch, out.parent, create=True):
                    pass
                rename_beneath(self.scratch, root / rel, out)
        rmtree_beneath(self.scratch, staging)
        return dest, used
