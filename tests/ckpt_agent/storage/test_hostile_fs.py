"""Issue #17: a hostile checkpoint volume. Links, FIFOs and devices planted in the store
(by anyone who can write the volume, the training pod's own code included) must never
make the filesystem backend, ``gc_blobs``, ``delete_checkpoint``, ``apply_retention``
or ``ckpt gc`` read or delete anything outside the storage root, nor hang.

Every test plants real files in ``tmp_path``: ``outside/`` holds what must survive
byte for byte, ``store/`` is the storage root.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.decide.retention import RetentionPlan
from ckpt_agent.errors import NotFoundError, UnsafePathError
from ckpt_agent.format.layout import blob_key, blobs_prefix, checkpoint_prefix, validation_key
from ckpt_agent.format.listing import list_checkpoints
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.format.verify import verify_hashes
from ckpt_agent.persist.housekeeping import apply_retention, delete_checkpoint, gc_blobs
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointStatus, checkpoint_id
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions

RUN = "run1"
FAKE = "ab" * 32  # a digest no manifest references
T = TypeVar("T")


# --------------------------------------------------------------------------- helpers


def tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: file contents, ``"dir"`` for folders, link targets."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"-> {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the store whose every byte must survive."""
    out = tmp_path / "outside"
    (out / "sub").mkdir(parents=True)
    (out / "secret.txt").write_bytes(b"do not read or delete")
    (out / "sub" / "deep.txt").write_bytes(b"nor this")
    (out / "COMMIT").write_bytes(b"looks like a checkpoint file")
    (out / "rank_00000.json").write_bytes(b"{}")
    (out / "sha256" / FAKE[:2]).mkdir(parents=True)
    (out / "sha256" / FAKE[:2] / FAKE).write_bytes(b"looks like an unreferenced blob")
    return out


@pytest.fixture
def store(tmp_path: Path) -> LocalStorage:
    return LocalStorage(tmp_path / "store", StorageOptions(fsync=False))


def populate(store: LocalStorage, steps: tuple[int, ...] = (10, 20, 30)) -> list[str]:
    """Committed, validated pulse checkpoints of one rank, each with one 16 KiB blob."""
    writer = CheckpointWriter(store, RUN, chunk_bytes=1 << 20)
    state = {"model": {"w": {"__tensor__": "model/w"}}}
    prev: str | None = None
    for step in steps:
        meta = CheckpointMeta(
            RUN, step, Tier.PULSE, created_at=1e9 + step, sections=("model",), prev_hash=prev
        )
        weights = memoryview(struct.pack("<4096f", *(float(i * step) for i in range(4096))))
        rank = writer.write_rank(
            meta, 0, state, [TensorSource("model/w", "float32", (4096,), weights)]
        )
        prev = writer.commit(meta, [rank]).manifest_hash
        cid = checkpoint_id(Tier.PULSE, step)
        verdict = ValidationVerdict(cid, prev, CheckpointStatus.VALID)
        store.commit(validation_key(RUN, cid), verdict.to_bytes())
    return [checkpoint_id(Tier.PULSE, step) for step in steps]


def step_dir(store: LocalStorage, cid: str) -> Path:
    return store.root / checkpoint_prefix(RUN, cid)


def quickly(fn: Callable[[], T], timeout: float = 10.0) -> T:
    """Run ``fn`` in a thread; fail (instead of hanging the suite) if it blocks."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still blocked after {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def gc(store: LocalStorage, grace: float | None) -> Any:
    """``gc_blobs`` with ``grace`` (None: its default), long after every write."""
    if grace is None:
        return gc_blobs(store, RUN, now=2e9)
    return gc_blobs(store, RUN, grace_s=grace, now=2e9)


def gc_cli(store: LocalStorage, tmp_path: Path, *extra: str) -> Any:
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"retention": {"routineKeep": 1}}))
    args = ["gc", "--storage", str(store.root), "--run-id", RUN, "--config", str(cfg), *extra]
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"})


# --------------------------------------------------------------------------- the backend


def test_symlinked_blob_is_refused_for_reading_and_skipped_by_listing(
    store: LocalStorage, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = tree(outside)
    key = blob_key(RUN, FAKE)
    store.write(blob_key(RUN, "cd" * 32), b"a real blob")
    (store.root / key).parent.mkdir(parents=True)
    os.symlink(outside / "secret.txt", store.root / key)
    for call in (
        lambda: store.read(key),
        lambda: store.read(key, 0, 5),
        lambda: store.stat(key),
        lambda: store.exists(key),
        lambda: store.open_read(key),
        lambda: store.read_view(key).__enter__(),
        lambda: store.read_into(key, memoryview(bytearray(11))),
    ):
        with pytest.raises(UnsafePathError, match="symbolic link") as ei:
            call()
        assert str(outside / "secret.txt") in str(ei.value)  # says where the link points
    # a link is no object: listing skips it, never follows it, and says so
    assert [i.key for i in store.list(blobs_prefix(RUN))] == [blob_key(RUN, "cd" * 32)]
    assert [i.key for i in store.list(f"{RUN}/", delimiter="/")] == [f"{RUN}/blobs/"]
    (store.root / blob_key(RUN, "cd" * 32)).unlink()  # only the link is left below blobs/
    assert list(store.list(f"{RUN}/", delimiter="/")) == []
    assert store.unsafe_entries == 3
    assert "symbolic link" in caplog.text and "planted" in caplog.text
    store.delete(key)  # the key's own entry: the link goes, not its target
    assert not os.path.lexists(store.root / key)
    assert tree(outside) == before


def test_symlinked_folder_is_never_entered(store: LocalStorage, outside: Path) -> None:
    before = tree(outside)
    store.write(f"{RUN}/steps/real/COMMIT", b"ok")
    os.symlink(outside, store.root / RUN / "steps" / "evil")
    for call in (
        lambda: store.read(f"{RUN}/steps/evil/secret.txt"),
        lambda: store.stat(f"{RUN}/steps/evil/secret.txt"),
        lambda: store.open_read(f"{RUN}/steps/evil/sub/deep.txt"),
        lambda: list(store.list(f"{RUN}/steps/evil/")),
        lambda: list(store.list(f"{RUN}/steps/evil/sub/", delimiter="/")),
        lambda: store.delete(f"{RUN}/steps/evil/secret.txt"),
        lambda: store.delete_prefix(f"{RUN}/steps/evil/"),
        lambda: store.write(f"{RUN}/steps/evil/new", b"x"),
        lambda: store.commit(f"{RUN}/steps/evil/sub/COMMIT", b"x"),
    ):
        with pytest.raises(UnsafePathError):
            call()
    assert [i.key for i in store.list(f"{RUN}/steps/")] == [f"{RUN}/steps/real/COMMIT"]
    assert [i.key for i in store.list(f"{RUN}/steps/", delimiter="/")] == [f"{RUN}/steps/real/"]
    assert tree(outside) == before
    # deleting the folder that holds the link removes the link, not what it points to
    assert store.delete_prefix(f"{RUN}/steps/") == 1
    assert not os.path.lexists(store.root / RUN / "steps")
    assert tree(outside) == before


def test_links_inside_a_deleted_folder_are_unlinked_not_followed(
    store: LocalStorage, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    before = tree(outside)
    store.write(f"{RUN}/steps/s1/COMMIT", b"ok")
    store.write(f"{RUN}/steps/s1/nested/rank_00000.json", b"{}")
    s1 = store.root / RUN / "steps" / "s1"
    os.symlink(outside, s1 / "to_folder")
    os.symlink(outside / "secret.txt", s1 / "to_file")
    os.symlink(outside / "sub", s1 / "nested" / "deeper")
    os.symlink(s1 / "gone", s1 / "dangling")
    assert store.delete_prefix(f"{RUN}/steps/s1/") == 2  # the two objects; links are not
    assert not s1.exists() and not os.path.lexists(s1)
    assert tree(outside) == before
    assert "symbolic link" in caplog.text  # each removed link is logged


def test_symlinked_blobs_folder(store: LocalStorage, outside: Path) -> None:
    before = tree(outside)
    (store.root / RUN).mkdir(parents=True)
    os.symlink(outside, store.root / RUN / "blobs")
    with pytest.raises(UnsafePathError):
        list(store.list(blobs_prefix(RUN)))
    with pytest.raises(UnsafePathError):
        store.delete_prefix(blobs_prefix(RUN))
    with pytest.raises(UnsafePathError):
        store.write(blob_key(RUN, "ef" * 32), b"never written outside")
    with pytest.raises(UnsafePathError):
        store.delete(blob_key(RUN, FAKE))
    assert tree(outside) == before
    assert store.delete_prefix(f"{RUN}/") == 0  # removes the link itself
    assert not os.path.lexists(store.root / RUN)
    assert tree(outside) == before


def test_link_swapped_in_after_the_check_is_still_not_followed(
    store: LocalStorage, outside: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check-then-open race: O_NOFOLLOW refuses a link that appears after lstat."""
    store.write("k", b"real")
    os.replace(store.root / "k", store.root / "real")
    os.symlink(outside / "secret.txt", store.root / "k")
    real_stat = os.stat
    looks_regular = real_stat(store.root / "real")

    def lying_stat(path: Any, *a: Any, **kw: Any) -> os.stat_result:
        if path == "k":
            return looks_regular
        return real_stat(path, *a, **kw)

    monkeypatch.setattr(os, "stat", lying_stat)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        store.read("k")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        store.open_read("k")


def test_the_root_itself_may_be_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "volume"
    real.mkdir()
    os.symlink(real, tmp_path / "mounted")
    store = LocalStorage(tmp_path / "mounted")
    assert store.root == real  # resolved once
    store.write("a/b", b"1")
    assert store.read("a/b") == b"1"
    assert [i.key for i in store.list()] == ["a/b"]
    assert store.delete_prefix("a/") == 1
    assert (tmp_path / "mounted").is_symlink() and real.is_dir()


@pytest.mark.timeout(60)
def test_fifo_and_device_behind_a_key_fail_fast(store: LocalStorage, tmp_path: Path) -> None:
    store.write("ok", b"fine")
    os.mkfifo(store.root / "fifo")
    os.symlink("/dev/zero", store.root / "zero")
    for key in ("fifo", "zero"):
        for call in (
            lambda k=key: store.read(k),
            lambda k=key: store.read(k, 0, 10),
            lambda k=key: store.open_read(k),
            lambda k=key: store.read_view(k).__enter__(),
            lambda k=key: store.read_into(k, memoryview(bytearray(10))),
            lambda k=key: store.stat(k),
        ):
            with pytest.raises(UnsafePathError):
                quickly(call)
    with pytest.raises(UnsafePathError, match="FIFO"):
        quickly(lambda: store.read("fifo"))
    os.unlink(store.root / "zero")
    assert [i.key for i in quickly(lambda: list(store.list()))] == ["ok"]  # not an object
    store.delete("fifo")  # removed as an entry, never opened
    assert not os.path.lexists(store.root / "fifo")


def test_directory_is_still_not_found(store: LocalStorage) -> None:
    store.write("d/x", b"1")
    with pytest.raises(NotFoundError):
        store.read("d")
    with pytest.raises(NotFoundError):
        store.stat("d")
    with pytest.raises(NotFoundError):
        store.read("d/x/y")  # a file where a folder is expected: missing, as before


def test_reads_stop_at_the_size_seen_plus_one(
    store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole-object read takes at most fstat's size + 1 bytes (never streams on)."""
    store.write("k", b"x" * 100)
    real_fstat = os.fstat

    class Shrunk:
        def __init__(self, st: os.stat_result) -> None:
            self.st_mode, self.st_size = st.st_mode, 10

    def fstat(fd: int) -> Any:
        return Shrunk(real_fstat(fd))

    monkeypatch.setattr(os, "fstat", fstat)  # as if the file grew after we looked
    assert store.read("k") == b"x" * 11
    assert store.read("k", 5) == b"x" * 6
    assert store.read("k", 0, 50) == b"x" * 50  # an explicit length is the caller's bound


# --------------------------------------------------------------------------- housekeeping


@pytest.mark.parametrize("grace", [0.0, None])  # None: the default grace
def test_gc_blobs_never_follows_a_planted_blob(
    store: LocalStorage, outside: Path, grace: float | None, caplog: pytest.LogCaptureFixture
) -> None:
    populate(store)
    before = tree(outside)
    (store.root / blob_key(RUN, FAKE)).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside / "sha256" / FAKE[:2] / FAKE, store.root / blob_key(RUN, FAKE))
    res = gc(store, grace)
    assert FAKE not in res.deleted and res.referenced == 3
    assert tree(outside) == before
    assert os.path.islink(store.root / blob_key(RUN, FAKE))  # reported, left for a human
    assert store.unsafe_entries >= 1 and FAKE in caplog.text and "symbolic link" in caplog.text


@pytest.mark.parametrize("grace", [0.0, None])  # None: the default grace
@pytest.mark.parametrize("where", ["step folder", "inside a step", "blob", "blob shard"])
def test_gc_blobs_skips_and_reports_planted_folders(
    store: LocalStorage, outside: Path, grace: float | None, where: str
) -> None:
    ids = populate(store)
    before = tree(outside)
    if where == "step folder":  # looks like an uncommitted (stale) checkpoint
        os.symlink(outside, store.root / RUN / "steps" / "pulse_step_000000000099")
    elif where == "inside a step":
        os.symlink(outside, step_dir(store, ids[0]) / "extra")
    elif where == "blob":  # a blob name that is a link to a folder
        (store.root / blob_key(RUN, FAKE)).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(outside, store.root / blob_key(RUN, FAKE))
    else:  # a shard folder (blobs/sha256/ab/) that is a link
        os.symlink(outside / "sha256" / FAKE[:2], store.root / blobs_prefix(RUN) / FAKE[:2])
    res = gc(store, grace)
    assert res.stale_folders == [] and res.deleted == [] and res.referenced == 3
    assert store.unsafe_entries >= 1
    assert tree(outside) == before


@pytest.mark.parametrize("grace", [0.0, None])
def test_gc_blobs_with_a_symlinked_blobs_folder_fails_loudly(
    store: LocalStorage, outside: Path, grace: float | None
) -> None:
    populate(store)
    before = tree(outside)
    blobs = store.root / RUN / "blobs"
    os.rename(blobs, store.root / RUN / "old-blobs")
    os.symlink(outside, blobs)  # outside/sha256/ab/abab… looks like an unreferenced blob
    with pytest.raises(UnsafePathError, match="symbolic link"):
        gc(store, grace)
    assert tree(outside) == before


def test_delete_checkpoint_on_a_symlinked_step_folder(store: LocalStorage, outside: Path) -> None:
    ids = populate(store)
    before = tree(outside)
    evil = checkpoint_id(Tier.PULSE, 99)
    os.symlink(outside, step_dir(store, evil))
    with pytest.raises(UnsafePathError):
        delete_checkpoint(store, RUN, evil)
    with pytest.raises(UnsafePathError):
        apply_retention(store, RUN, RetentionPlan(deletion_order=(evil,)))
    assert tree(outside) == before
    os.unlink(step_dir(store, evil))
    assert [r.id for r in list_checkpoints(store, RUN)] == ids


def test_retention_deletes_a_step_with_links_inside_but_not_their_targets(
    store: LocalStorage, outside: Path
) -> None:
    ids = populate(store)
    before = tree(outside)
    os.symlink(outside, step_dir(store, ids[0]) / "planted")
    os.symlink(outside / "secret.txt", step_dir(store, ids[1]) / "rank_00001.json")
    assert apply_retention(store, RUN, RetentionPlan(deletion_order=(ids[1], ids[0]))) == [
        ids[1],
        ids[0],
    ]
    assert not os.path.lexists(step_dir(store, ids[0]))
    assert not os.path.lexists(step_dir(store, ids[1]))
    assert [r.id for r in list_checkpoints(store, RUN)] == [ids[2]]
    res = gc_blobs(store, RUN, grace_s=0)  # the trainer's own GC after a save
    assert len(res.deleted) == 2 and not res.unreadable_manifests
    _, m = read_checkpoint(store, RUN, ids[2])
    assert m.tensors["model/w"].chunks
    assert tree(outside) == before


# --------------------------------------------------------------------------- ckpt gc


@pytest.mark.parametrize("grace", ["0", None])
def test_ckpt_gc_with_a_planted_blob(
    store: LocalStorage,
    outside: Path,
    tmp_path: Path,
    grace: str | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    populate(store)
    before = tree(outside)
    (store.root / blob_key(RUN, FAKE)).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside / "sha256" / FAKE[:2] / FAKE, store.root / blob_key(RUN, FAKE))
    res = gc_cli(store, tmp_path, *(["--grace", grace] if grace else []))
    assert res.exit_code == 0, res.output
    assert "deleted 2 checkpoint(s)" in res.output
    assert "symbolic link" in caplog.text and FAKE in caplog.text
    assert os.path.islink(store.root / blob_key(RUN, FAKE))
    assert tree(outside) == before


def test_ckpt_gc_with_a_symlinked_step_folder(
    store: LocalStorage, outside: Path, tmp_path: Path
) -> None:
    populate(store)
    before = tree(outside)
    os.symlink(outside, store.root / RUN / "steps" / "pulse_step_000000000005")
    res = gc_cli(store, tmp_path, "--grace", "0")
    assert res.exit_code == 0, res.output
    assert "deleted 2 checkpoint(s)" in res.output and "pulse_step_000000000005" not in res.output
    assert os.path.islink(store.root / RUN / "steps" / "pulse_step_000000000005")
    assert tree(outside) == before


def test_ckpt_gc_with_a_symlinked_blobs_folder(
    store: LocalStorage, outside: Path, tmp_path: Path
) -> None:
    populate(store)
    before = tree(outside)
    blobs = store.root / RUN / "blobs"
    os.rename(blobs, store.root / RUN / "old-blobs")
    os.symlink(outside, blobs)
    res = gc_cli(store, tmp_path, "--grace", "0")
    assert res.exit_code != 0
    assert isinstance(res.exception, UnsafePathError) or "symbolic link" in res.output
    assert tree(outside) == before


def test_ckpt_gc_deletes_a_step_holding_links_and_spares_their_targets(
    store: LocalStorage, outside: Path, tmp_path: Path
) -> None:
    ids = populate(store)
    before = tree(outside)
    os.symlink(outside, step_dir(store, ids[0]) / "planted")
    res = gc_cli(store, tmp_path, "--grace", "0")
    assert res.exit_code == 0, res.output
    assert "deleted 2 checkpoint(s)" in res.output
    assert [r.id for r in list_checkpoints(store, RUN)] == [ids[2]]
    assert tree(outside) == before


# --------------------------------------------------------------------------- verification


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_verify_fails_fast_on_a_fifo_or_device_blob(store: LocalStorage, kind: str) -> None:
    ids = populate(store, (10,))
    _, m = read_checkpoint(store, RUN, ids[0])
    digest = m.tensors["model/w"].chunks[0]
    path = store.root / blob_key(RUN, digest)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink("/dev/zero", path)
    result = quickly(lambda: verify_hashes(store, RUN, ids[0]))
    assert not result.ok
    assert "FIFO" in result.reason or "symbolic link" in result.reason


def test_a_root_replaced_after_opening_is_not_followed(tmp_path: Path, outside: Path) -> None:
    """The root is resolved once; a link swapped in for it later is refused."""
    before = tree(outside)
    store = LocalStorage(tmp_path / "vol")
    store.write("a", b"1")
    os.rename(tmp_path / "vol", tmp_path / "vol-old")
    os.symlink(outside, tmp_path / "vol")
    with pytest.raises(UnsafePathError):
        store.read("secret.txt")
    with pytest.raises(UnsafePathError):
        list(store.list())
    with pytest.raises(UnsafePathError):
        store.delete_prefix("")
    assert tree(outside) == before
    os.unlink(tmp_path / "vol")
    (tmp_path / "vol").write_bytes(b"a file where the root was")
    assert list(store.list()) == [] and not store.exists("a")  # missing, as before
