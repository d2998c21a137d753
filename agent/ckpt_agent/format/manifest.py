"""The checkpoint's documents: the rank manifests and the COMMIT (and the meta both carry).

Torch-free and numpy-free: the operator imports it. The ``COMMIT`` lists
every rank manifest with its SHA-256, every rank manifest lists its blobs
with their SHA-256, so one hash (the COMMIT's, the checkpoint's
``manifest_hash``) pins every byte. Each manifest carries the hash of the
previous weights checkpoint (``prev_hash``): the chain the recovery ladder
walks, and, once the run was resumed from a pin, its resume ``lineage``
(:class:`~ckpt_agent.records.Lineage`). Where they are stored is
:mod:`ckpt_agent.format.layout`; reading them back with their hashes checked
is :mod:`ckpt_agent.format.readers`. The entries a rank manifest lists are
:mod:`ckpt_agent.format.entries`; the validator's verdict is
:mod:`ckpt_agent.format.verdict`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.format.codec import zstd_version
from ckpt_agent.format.entries import BlobEntry, TensorEntry
from ckpt_agent.format.layout import (
    COMMIT_MAX_BYTES,
    FORMAT_COMMIT,
    FORMAT_RANK,
    FORMAT_VERSION,
    dumps,
    is_rank_file,
    loads,
)
from ckpt_agent.format.schema import digest_field, nonneg_field, optional_field, required_field
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import (
    CheckpointRecord,
    CheckpointStatus,
    Json,
    Lineage,
    RetentionClass,
    checkpoint_id,
)
from ckpt_agent.version import __version__

__all__ = [
    "CheckpointMeta",
    "CommitManifest",
    "RankManifest",
    "RankRef",
    "library_versions",
    "lineage_from_json",
    "lineage_to_json",
]


# --------------------------------------------------------------------------- checkpoint meta


@dataclass(frozen=True)
class CheckpointMeta:
    """What both the rank manifests and the COMMIT say about a checkpoint."""

    run_id: str
    step: int
    tier: Tier
    world_size: int = 1
    created_at: float = 0.0
    score: float = 0.0
    components: Mapping[str, float] = field(default_factory=dict)
    retention_class: RetentionClass | None = None
    reason: str = ""
    anomaly: str | None = None
    lightweight: bool = False
    approximate: bool = False
    emergency: bool = False
    prev_hash: str | None = None
    sections: tuple[str, ...] = ()
    versions: Mapping[str, str] = field(default_factory=dict)
    lineage: Lineage = field(default_factory=Lineage)
    """The resume lineage (written only when not the run's original one)."""
    generation: int = 0
    """The writer generation that wrote it (:mod:`ckpt_agent.format.fence`; 0: none
    claimed, written only when set)."""

    @property
    def checkpoint_id(self) -> str:
        return checkpoint_id(self.tier, self.step)

    def to_json(self) -> dict[str, Json]:
        return {
            "version": FORMAT_VERSION,
            "run_id": self.run_id,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "tier": self.tier.value,
            "world_size": self.world_size,
            "created_at": self.created_at,
            "score": self.score,
            "components": dict(self.components),
            "retention_class": self.retention_class.value if self.retention_class else None,
            "reason": self.reason,
            "anomaly": self.anomaly,
            "lightweight": self.lightweight,
            "approximate": self.approximate,
            "emergency": self.emergency,
            "prev_hash": self.prev_hash,
            "sections": list(self.sections),
            "versions": dict(self.versions),
            **({"lineage": lineage_to_json(self.lineage)} if self.lineage != Lineage() else {}),
            **({"generation": self.generation} if self.generation else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Json], what: str) -> CheckpointMeta:
        version = required_field(d, "version", int, what)
        if version != FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{what}: format version {version} is not supported by this version "
                f"(knows {FORMAT_VERSION}); upgrade ckpt-operator"
            )
        tier_raw = required_field(d, "tier", str, what)
        try:
            tier = Tier(tier_raw)
        except ValueError:
            raise CheckpointFormatError(f"{what}: unknown tier {tier_raw!r}") from None
        step = nonneg_field(d.get("step"), f"{what}.step")
        cid = required_field(d, "checkpoint_id", str, what)
        if cid != checkpoint_id(tier, step):
            raise CheckpointFormatError(f"{what}: checkpoint_id {cid!r} disagrees with tier/step")
        rc_raw = optional_field(d, "retention_class", str, what)
        try:
            rc = RetentionClass(rc_raw) if rc_raw else None
        except ValueError:
            raise CheckpointFormatError(f"{what}: unknown retention class {rc_raw!r}") from None
        comps = d.get("components") or {}
        if not isinstance(comps, dict) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in comps.values()
        ):
            raise CheckpointFormatError(f"{what}: components must map names to numbers")
        versions = d.get("versions") or {}
        if not isinstance(versions, dict):
            raise CheckpointFormatError(f"{what}: versions must be an object")
        prev = d.get("prev_hash")
        sections = d.get("sections") or []
        if not isinstance(sections, list) or not all(isinstance(s, str) for s in sections):
            raise CheckpointFormatError(f"{what}: sections must be a list of names")
        return cls(
            run_id=required_field(d, "run_id", str, what),
            step=step,
            tier=tier,
            world_size=max(1, nonneg_field(d.get("world_size", 1), f"{what}.world_size")),
            created_at=float(required_field(d, "created_at", (int, float), what)),
            score=float(required_field(d, "score", (int, float), what)),
            components={str(k): float(v) for k, v in comps.items()},
            retention_class=rc,
            reason=str(d.get("reason") or ""),
            anomaly=optional_field(d, "anomaly", str, what),
            lightweight=bool(d.get("lightweight", False)),
            approximate=bool(d.get("approximate", False)),
            emergency=bool(d.get("emergency", False)),
            prev_hash=None if prev is None else digest_field(prev, f"{what}.prev_hash"),
            sections=tuple(sections),
            versions={str(k): str(v) for k, v in versions.items()},
            generation=nonneg_field(d.get("generation", 0), f"{what}.generation"),
            lineage=lineage_from_json(d.get("lineage"), f"{what}.lineage"),
        )


def lineage_to_json(lineage: Lineage) -> dict[str, Json]:
    """The manifest's ``lineage`` object."""
    return {"epoch": lineage.epoch, "pins": list(lineage.pins), "parent": lineage.parent}


def lineage_from_json(d: Json, what: str) -> Lineage:
    """A manifest's ``lineage`` object (absent or null: the run's original lineage)."""
    if d is None:
        return Lineage()
    if not isinstance(d, dict):
        raise CheckpointFormatError(f"{what}: must be an object")
    pins = d.get("pins") or []
    if not isinstance(pins, list) or not all(isinstance(p, str) for p in pins):
        raise CheckpointFormatError(f"{what}.pins: must be a list of strings")
    return Lineage(
        epoch=nonneg_field(d.get("epoch", 0), f"{what}.epoch"),
        pins=tuple(pins),
        parent=optional_field(d, "parent", str, what),
    )


def library_versions(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Versions recorded in every manifest (the torch side adds torch/numpy)."""
    out = {
        "ckpt_agent": __version__,
        "python": ".".join(map(str, sys.version_info[:3])),
        "zstandard": zstd_version(),
        "format": str(FORMAT_VERSION),
    }
    if extra:
        out.update(extra)
    return out


@dataclass(frozen=True)
class RankManifest:
    """One rank's part of a checkpoint."""

    meta: CheckpointMeta
    rank: int
    state: Json
    """The tagged-JSON state tree (:mod:`ckpt_agent.format.jsontree`), tensors by reference."""
    tensors: Mapping[str, TensorEntry]
    blobs: Mapping[str, BlobEntry]
    files: Mapping[str, TensorEntry] = field(default_factory=dict)
    """Extra files (``train_config.json``) stored like uint8 tensors."""
    stats: Mapping[str, int] = field(default_factory=dict)
    """bytes_new, bytes_reused, blobs_new, blobs_reused, raw_bytes."""

    @property
    def checkpoint_id(self) -> str:
        return self.meta.checkpoint_id

    def to_bytes(self) -> bytes:
        doc = self.meta.to_json()
        doc.update(
            {
                "format": FORMAT_RANK,
                "rank": self.rank,
                "byte_order": sys.byteorder,
                "state": self.state,
                "tensors": {k: v.to_json() for k, v in self.tensors.items()},
                "blobs": {k: v.to_json() for k, v in self.blobs.items()},
                "files": {k: v.to_json() for k, v in self.files.items()},
                "stats": dict(self.stats),
            }
        )
        return dumps(doc)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "rank manifest") -> RankManifest:
        d = loads(data, what)
        if d.get("format") != FORMAT_RANK:
            raise CheckpointFormatError(f"{what}: not a rank manifest (format {d.get('format')!r})")
        meta = CheckpointMeta.from_json(d, what)
        blobs_raw = required_field(d, "blobs", dict, what)
        blobs = {
            k: BlobEntry.from_json(k, v, f"{what}: blob {k[:12]}") for k, v in blobs_raw.items()
        }
        tensors: dict[str, TensorEntry] = {}
        files: dict[str, TensorEntry] = {}
        for section, out in (("tensors", tensors), ("files", files)):
            raw = d.get(section) or {}
            if not isinstance(raw, dict):
                raise CheckpointFormatError(f"{what}: {section} must be an object")
            for name, entry in raw.items():
                t = TensorEntry.from_json(entry, f"{what}: {section[:-1]} {name!r}")
                total = 0
                for c in t.chunks:
                    if c not in blobs:
                        raise CheckpointFormatError(
                            f"{what}: {section[:-1]} {name!r} references unknown blob {c[:12]}"
                        )
                    total += blobs[c].raw_size
                if t.inline is None and total != t.nbytes:
                    raise CheckpointFormatError(
                        f"{what}: chunks of {name!r} hold {total} bytes, tensor has {t.nbytes}"
                    )
                out[name] = t
        stats = d.get("stats") or {}
        if not isinstance(stats, dict):
            raise CheckpointFormatError(f"{what}: stats must be an object")
        return cls(
            meta=meta,
            rank=nonneg_field(d.get("rank"), f"{what}.rank"),
            state=d.get("state"),
            tensors=tensors,
            blobs=blobs,
            files=files,
            stats={str(k): int(v) for k, v in stats.items() if isinstance(v, int)},
        )

    def referenced_blobs(self) -> set[str]:
        out: set[str] = set()
        for t in (*self.tensors.values(), *self.files.values()):
            out.update(t.chunks)
        return out


@dataclass(frozen=True)
class RankRef:
    """A rank manifest as listed in the COMMIT."""

    rank: int
    key: str
    """Name inside the checkpoint folder (``rank_00000.json``)."""
    sha256: str
    size: int

    def to_json(self) -> dict[str, Json]:
        return {"rank": self.rank, "key": self.key, "sha256": self.sha256, "size": self.size}


@dataclass(frozen=True)
class CommitManifest:
    """The global manifest, published last: the checkpoint exists once it does."""

    meta: CheckpointMeta
    ranks: tuple[RankRef, ...]
    size_bytes: int = 0
    """Bytes this checkpoint added to storage (new blobs + manifests)."""
    raw_bytes: int = 0
    """Decoded size of everything it references."""

    @property
    def checkpoint_id(self) -> str:
        return self.meta.checkpoint_id

    def to_bytes(self) -> bytes:
        doc = self.meta.to_json()
        doc.update(
            {
                "format": FORMAT_COMMIT,
                "ranks": [r.to_json() for r in self.ranks],
                "size_bytes": self.size_bytes,
                "raw_bytes": self.raw_bytes,
            }
        )
        return dumps(doc)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "COMMIT") -> CommitManifest:
        d = loads(data, what, COMMIT_MAX_BYTES)
        if d.get("format") != FORMAT_COMMIT:
            raise CheckpointFormatError(f"{what}: not a COMMIT (format {d.get('format')!r})")
        meta = CheckpointMeta.from_json(d, what)
        ranks_raw = required_field(d, "ranks", list, what)
        ranks: list[RankRef] = []
        for r in ranks_raw:
            if not isinstance(r, dict):
                raise CheckpointFormatError(f"{what}: ranks[] entries must be objects")
            key = required_field(r, "key", str, what)
            if not is_rank_file(key):
                raise CheckpointFormatError(f"{what}: bad rank manifest name {key!r}")
            ranks.append(
                RankRef(
                    rank=nonneg_field(r.get("rank"), f"{what}.rank"),
                    key=key,
                    sha256=digest_field(r.get("sha256"), f"{what}.ranks.sha256"),
                    size=nonneg_field(r.get("size"), f"{what}.ranks.size"),
                )
            )
        if sorted(r.rank for r in ranks) != list(range(meta.world_size)):
            raise CheckpointFormatError(
                f"{what}: lists ranks {sorted(r.rank for r in ranks)} "
                f"for world size {meta.world_size}"
            )
        return cls(
            meta=meta,
            ranks=tuple(ranks),
            size_bytes=nonneg_field(d.get("size_bytes", 0), f"{what}.size_bytes"),
            raw_bytes=nonneg_field(d.get("raw_bytes", 0), f"{what}.raw_bytes"),
        )

    def record(self, manifest_hash: str, status: CheckpointStatus) -> CheckpointRecord:
        m = self.meta
        return CheckpointRecord(
            id=m.checkpoint_id,
            step=m.step,
            tier=m.tier,
            status=status,
            score=m.score,
            retention_class=m.retention_class,
            size_bytes=self.size_bytes,
            created_at=m.created_at,
            manifest_hash=manifest_hash,
            prev_hash=m.prev_hash,
            anomaly=m.anomaly,
            lightweight=m.lightweight,
            approximate=m.approximate,
            emergency=m.emergency,
            world_size=m.world_size,
            reason=m.reason,
            lineage=m.lineage,
        )
