"""A rank restarted on another node gets its snapshot back from a peer's replica (#31).

The node a rank ran on is gone, and with it the rank's shared-memory area; its newest
snapshot lives on as a replica on the peers it was pushed to. Before the restarted
trainer resumes, it asks this node's sidecar for it through two small files in its (new,
empty) area:

1. the trainer writes ``rehydrate.request.json`` (a nonce) — only when its area holds no
   snapshot and a sidecar that answers such requests serves the run (it says so in
   ``<shm_dir>/<run>/sidecar.features.json``, :func:`advertise`: a sidecar of an older
   version never answers, and the trainer must not wait for it;
   :meth:`~ckpt_agent.runtime.shm.target.FlashTarget.rehydrate`);
2. the sidecar (:class:`~ckpt_agent.flash.sidecar.rehydration.Rehydration`) looks for
   the newest replica of that rank: in this node's replica store, then on each peer
   (:func:`~.fetch.list_replicas`); reads it back with every chunk verified
   (:func:`~.fetch.open_local`, :func:`~.fetch.fetch`), :func:`install`\\ s it into a free
   slot of the area as a complete snapshot, and writes ``rehydrate.answer.json`` (the
   nonce, what was found or why nothing was).

From there the snapshot is one like any other the in-place restart offers
(:mod:`ckpt_agent.runtime.shm.in_place`): every rank must hold the same save, at least as
new as storage's newest, and its bytes are checked against the recorded hashes before
they are applied; otherwise every rank resumes from storage. The installed snapshot is
marked handled (it was taken by the rank's old node and is not persisted again from
here). Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from ckpt_agent.flash.area import ShmArea
from ckpt_agent.flash.checksums import HASH_CHUNK_BYTES, chunk_hashes, fast_checksums
from ckpt_agent.flash.protocol import (
    HEADER,
    MAGIC,
    Descriptor,
    PersistedMark,
    atomic_write,
    read_doc,
    try_flock,
)
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.replica.client import Peer
from ckpt_agent.flash.replica.fetch import Replica
from ckpt_agent.format.layout import validate_run_id
from ckpt_agent.records import Json

__all__ = [
    "ANSWER",
    "FEATURES",
    "REQUEST",
    "Held",
    "RehydrateAnswer",
    "Slot",
    "advertise",
    "advertised",
    "check_fits",
    "free_slot",
    "install",
    "newest_held",
    "publish",
    "read_answer",
    "read_request",
    "write_answer",
    "write_request",
]

FEATURES: Final = "sidecar.features.json"
REHYDRATE: Final = "rehydrate"
"""The feature a sidecar that answers rehydrate requests advertises."""
REQUEST: Final = "rehydrate.request.json"
ANSWER: Final = "rehydrate.answer.json"
_FORMAT: Final = "ckpt-operator.rehydrate"


# --------------------------------------------------------------------------- the files


def advertise(shm_dir: str | Path, run_id: str) -> None:
    """The sidecar says it answers rehydrate requests (at its start)."""
    d = Path(shm_dir) / validate_run_id(run_id)
    d.mkdir(parents=True, exist_ok=True)
    doc = {"format": _FORMAT, "features": [REHYDRATE], "time": time.time()}
    atomic_write(d / FEATURES, json.dumps(doc).encode())


def advertised(shm_dir: str | Path, run_id: str) -> bool:
    """A sidecar of this run on this node answers rehydrate requests."""
    d = read_doc(Path(shm_dir) / validate_run_id(run_id) / FEATURES, _FORMAT)
    features = d.get("features") if d is not None else None
    return isinstance(features, list) and REHYDRATE in features


def write_request(area: ShmArea, nonce: str) -> None:
    """The trainer asks for its rank's newest replica (a new nonce per ask)."""
    area.dir.mkdir(parents=True, exist_ok=True)
    atomic_write(area.dir / REQUEST, json.dumps({"format": _FORMAT, "nonce": nonce}).encode())


def read_request(area: ShmArea) -> str | None:
    """The nonce of the trainer's request (None: none, or not one)."""
    d = _read(area, REQUEST)
    nonce = d.get("nonce") if d is not None else None
    return nonce if isinstance(nonce, str) and nonce else None


@dataclass(frozen=True)
class RehydrateAnswer:
    """The sidecar's answer to one request."""

    nonce: str
    found: bool
    why: str = ""
    """What was installed, or why nothing was (in words)."""
    step: int | None = None
    seq: int | None = None
    """The installed snapshot's sequence number in the area."""
    source: str | None = None
    """The node whose snapshot it was."""

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "format": _FORMAT,
                "nonce": self.nonce,
                "found": self.found,
                "why": self.why,
                "step": self.step,
                "seq": self.seq,
                "source": self.source,
            },
            sort_keys=True,
        ).encode()


def write_answer(area: ShmArea, answer: RehydrateAnswer) -> None:
    atomic_write(area.dir / ANSWER, answer.to_bytes())


def read_answer(area: ShmArea, nonce: str) -> RehydrateAnswer | None:
    """The sidecar's answer to the request ``nonce`` (None: not answered yet)."""
    d = _read(area, ANSWER)
    if d is None or d.get("nonce") != nonce:
        return None
    step, seq, source = d.get("step"), d.get("seq"), d.get("source")
    return RehydrateAnswer(
        nonce=nonce,
        found=d.get("found") is True,
        why=str(d.get("why") or ""),
        step=step if isinstance(step, int) else None,
        seq=seq if isinstance(seq, int) else None,
        source=source if isinstance(source, str) else None,
    )


def _read(area: ShmArea, name: str) -> dict[str, Json] | None:
    return read_doc(area.dir / name, _FORMAT)


# --------------------------------------------------------------------------- the choice


@dataclass(frozen=True)
class Held:
    """A replica of the wanted rank somewhere: this node's store (``peer`` None) or a peer's."""

    peer: Peer | None
    source: str
    step: int
    seq: int


def newest_held(
    listed: Sequence[tuple[Peer | None, Mapping[str, object]]], rank: int
) -> list[Held]:
    """The replicas of ``rank`` among ``listed`` ((peer, entry) pairs, entries as
    :func:`~.fetch.list_replicas` gives them; peer None: this node's store), newest step
    first, this node's own store first among equals (no network); malformed entries are
    skipped. Pure."""
    out: list[Held] = []
    for peer, entry in listed:
        r, step, seq, source = (entry.get(k) for k in ("rank", "step", "seq", "source"))
        if r != rank or not isinstance(source, str):
            continue
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (step, seq)):
            continue
        assert isinstance(step, int) and isinstance(seq, int)
        out.append(Held(peer, source, step, seq))
    return sorted(out, key=lambda h: (-h.step, h.peer is not None, -h.seq))


# --------------------------------------------------------------------------- installing


@dataclass
class Slot:
    """A free slot of an area, locked and mapped for writing (:func:`free_slot`)."""

    index: int
    seq: int
    """The sequence number the snapshot written here gets."""
    view: memoryview


@contextlib.contextmanager
def free_slot(reader: ShmReader, data_size: int) -> Iterator[Slot]:
    """A slot of ``reader``'s area to write a ``data_size``-byte snapshot into (the first of
    :meth:`~ckpt_agent.flash.area.ShmArea.write_order`, as the trainer's writer picks);
    locked, its descriptor and hashes removed (it holds no complete snapshot from here
    on), sized and mapped writable. The area's trainer must not be
    running (it waits for the answer). Raises OSError when the area cannot be written."""
    reader.dir.mkdir(parents=True, exist_ok=True)
    seq, index = reader.highest_seq() + 1, reader.write_order()[0]
    fd = os.open(reader.data_path(index), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if not try_flock(fd, fcntl.LOCK_EX):
            raise OSError(f"slot {index} of {reader.dir} is in use")
        reader.desc_path(index).unlink(missing_ok=True)
        reader.hashes_path(index).unlink(missing_ok=True)
        os.ftruncate(fd, data_size)
        with contextlib.suppress(OSError):  # tmpfs: the pages now, not a SIGBUS later
            os.posix_fallocate(fd, 0, data_size)
        mm = mmap.mmap(fd, data_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(mm)
        try:
            yield Slot(index, seq, view)
        finally:
            view.release()
            mm.close()
    finally:
        os.close(fd)  # drops the lock


def publish(reader: ShmReader, slot: Slot, replica: Replica) -> Descriptor:
    """``replica``, whose bytes are in ``slot`` now, as a complete snapshot of the area: the
    slot header, its chunk hashes, the handled mark, then the descriptor (a new sequence
    number; the replica's step, tier, tree and meta) last: a crash before leaves no
    complete snapshot. The chunk hashes are the SHA-256s the replica was verified against
    and the fast checksums computed from the bytes so verified (:attr:`Replica.fast`) when
    they are at :data:`HASH_CHUNK_BYTES`; else computed here (one more pass)."""
    desc = replica.desc
    data = slot.view
    HEADER.pack_into(data, 0, MAGIC, slot.seq, slot.seq, desc.data_size)
    installed = replace(
        desc, seq=slot.seq, slot=slot.index, created_at=time.time(), pid=os.getpid()
    )
    views = {n: data[t.offset : t.offset + t.nbytes] for n, t in desc.tensors.items()}
    views.update({n: data[t.offset : t.offset + t.nbytes] for n, t in desc.files.items()})
    same = replica.chunk_bytes == HASH_CHUNK_BYTES
    try:
        sha = (  # verified against these when it was read back; else computed here
            {n: list(replica.hashes[n]) for n in views}
            if same and set(replica.hashes) >= set(views)
            else {n: chunk_hashes(v, HASH_CHUNK_BYTES) for n, v in views.items()}
        )
        fast = (  # of the bytes verified against those, as they were received or read
            {n: list(replica.fast[n]) for n in views}
            if same and replica.fast is not None and set(replica.fast) >= set(views)
            else {n: fast_checksums(v, HASH_CHUNK_BYTES) for n, v in views.items()}
        )
    finally:
        for v in views.values():
            v.release()
    reader.write_hashes(installed, sha, fast)
    reader.mark(
        PersistedMark(
            seq=slot.seq,
            step=desc.step,
            checkpoint_id=desc.checkpoint_id,
            ok=False,
            error="rehydrated from a peer's replica: not persisted from this node",
            time=time.time(),
        )
    )
    atomic_write(reader.desc_path(slot.index), installed.to_bytes())  # the commit marker
    return installed


def check_fits(reader: ShmReader, desc: Descriptor) -> None:
    """ValueError unless ``desc`` is a snapshot of ``reader``'s run and rank."""
    if desc.rank != reader.rank or desc.run_id != reader.run_id:
        raise ValueError(f"a replica of {desc.run_id} rank {desc.rank} in {reader.dir}")


def install(reader: ShmReader, replica: Replica) -> Descriptor:
    """Copy the verified ``replica`` into a free slot of ``reader``'s area and
    :func:`publish` it (a replica read from this node's store; one from a peer is received
    straight into the slot instead, :func:`~.fetch.fetch` ``into``)."""
    desc = replica.desc
    check_fits(reader, desc)
    with free_slot(reader, desc.data_size) as slot:
        slot.view[HEADER.size : desc.data_size] = replica.data[HEADER.size : desc.data_size]
        return publish(reader, slot, replica)
