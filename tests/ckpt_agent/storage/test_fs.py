"""Filesystem backend: real faults (a full tmpfs, a read-only mount, a user without
permission, a file size limit) and filesystem specifics (durability, stale entries)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt_agent.storage import PermanentStorageError, open_storage
from ckpt_agent.storage.base import TEMP_PREFIX
from ckpt_agent.storage.fs import LocalStorage

from .conftest import IS_ROOT, all_files

MIB = 1024 * 1024


def test_enospc_is_permanent_and_publishes_nothing(tiny_tmpfs: Path) -> None:
    store = LocalStorage(tiny_tmpfs / "ckpt")
    store.write("steps/1/blob", b"x" * 1000)
    store.commit("steps/1/COMMIT", b"ok")
    with pytest.raises(PermanentStorageError, match="no space left on device") as ei:
        with store.open_write("steps/2/blob") as f:
            for _ in range(4):
                f.write(b"y" * (MIB // 2))
    assert "nothing was published" in str(ei.value)
    assert "Free space" in str(ei.value)
    # nothing half-published, no temp file, the space is back, the old step is intact
    assert all_files(tiny_tmpfs) == ["ckpt/steps/1/COMMIT", "ckpt/steps/1/blob"]
    assert [i.key for i in store.list()] == ["steps/1/COMMIT", "steps/1/blob"]
    assert store.read("steps/1/blob") == b"x" * 1000
    store.write("steps/3/small", b"fits again")
    assert store.read("steps/3/small") == b"fits again"


def test_enospc_via_write_helper_and_commit(tiny_tmpfs: Path) -> None:
    store = LocalStorage(tiny_tmpfs)
    with pytest.raises(PermanentStorageError, match="no space"):
        store.write("big", b"z" * (2 * MIB))
    with pytest.raises(PermanentStorageError, match="no space"):
        store.commit("COMMIT", b"z" * (2 * MIB))
    assert all_files(tiny_tmpfs) == []


def test_read_only_filesystem_is_permanent(tmp_path: Path) -> None:
    if not IS_ROOT:
        pytest.skip("a read-only bind mount needs root")
    src = tmp_path / "vol"
    src.mkdir()
    (src / "old").write_bytes(b"kept")
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(src), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], check=True)
        store = LocalStorage(ro)
        with pytest.raises(PermanentStorageError, match="read-only filesystem") as ei:
            store.write("steps/1/blob", b"data")
        assert "read-write" in str(ei.value)
        with pytest.raises(PermanentStorageError, match="read-only"):
            store.write("new", b"data")  # directory already there: fails at the temp file
        with pytest.raises(PermanentStorageError, match="read-only"):
            store.delete("old")
        assert store.read("old") == b"kept"  # reading still works
        assert [i.key for i in store.list()] == ["old"]
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)
    assert all_files(src) == ["old"]


_DROP = "-dac_override,-dac_read_search,-fowner"


def _run_unprivileged(code: str, root: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` without the capabilities that let root ignore file permissions."""
    agent_dir = Path(__file__).resolve().parents[3] / "agent"
    script = f"import sys; sys.path.insert(0, {str(agent_dir)!r})\n" + textwrap.dedent(code)
    cmd = [sys.executable, "-c", script, str(root)]
    if IS_ROOT:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("as root, this test needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        cmd = [setpriv, f"--inh-caps={_DROP}", f"--bounding-set={_DROP}", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def test_permission_denied_is_permanent_with_what_to_fix(tmp_path: Path) -> None:
    root = tmp_path / "locked"
    root.mkdir()
    (root / "steps").mkdir()
    (root / "steps" / "old").write_bytes(b"kept")
    os.chmod(root, 0o555)
    os.chmod(root / "steps", 0o555)
    proc = _run_unprivileged(
        """
        from ckpt_agent.storage.fs import LocalStorage
        from ckpt_agent.storage import PermanentStorageError
        s = LocalStorage(sys.argv[1])
        for key in ("steps/new", "other/x"):
            try:
                s.write(key, b"data")
            except PermanentStorageError as e:
                print("PERMANENT", e)
        print("READ", s.read("steps/old"))
        """,
        root,
    )
    os.chmod(root / "steps", 0o755)
    os.chmod(root, 0o755)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len([x for x in lines if x.startswith("PERMANENT")]) == 2, proc.stdout
    assert "permission denied for uid" in lines[0]
    assert "fsGroup" in lines[0] and "nothing was published" in lines[0]
    assert lines[-1] == "READ b'kept'"
    assert all_files(root) == ["steps/old"]


def test_file_size_limit_is_permanent(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (EFBIG): another real out-of-space condition."""
    code = textwrap.dedent(
        f"""
        import resource, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[3] / "agent")!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        from ckpt_agent.storage.fs import LocalStorage
        from ckpt_agent.storage import PermanentStorageError
        s = LocalStorage(sys.argv[1])
        try:
            s.write("big", b"x" * 300_000)
        except PermanentStorageError as e:
            print("PERMANENT", e)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("PERMANENT") and "file too large" in proc.stdout
    assert all_files(tmp_path) == []


def test_key_that_is_also_a_prefix_is_a_clear_error(tmp_path: Path) -> None:
    store = LocalStorage(tmp_path)
    store.write("a/b", b"1")
    with pytest.raises(PermanentStorageError, match="both an object and the prefix"):
        store.write("a", b"2")
    with pytest.raises(PermanentStorageError, match="both an object and the prefix"):
        store.write("a/b/c", b"3")
    assert all_files(tmp_path) == ["a/b"]


def test_crash_leftovers_are_invisible(tmp_path: Path) -> None:
    """A temp file left by a killed writer is never listed, read or counted."""
    store = LocalStorage(tmp_path)
    store.write("steps/1/COMMIT", b"ok")
    (tmp_path / "steps" / "2").mkdir()
    (tmp_path / "steps" / "2" / f"{TEMP_PREFIX}blob.123").write_bytes(b"half")
    (tmp_path / "steps" / "1" / f"{TEMP_PREFIX}COMMIT.456").write_bytes(b"half")
    assert [i.key for i in store.list()] == ["steps/1/COMMIT"]
    assert [i.key for i in store.list("steps/", delimiter="/")] == ["steps/1/"]


def test_publish_fsyncs_file_and_every_created_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    store = LocalStorage(tmp_path / "root")
    store.commit("run/steps/1/COMMIT", b"ok")
    root = tmp_path / "root"
    assert str(root / "run" / "steps" / "1") in synced  # the target's directory
    for d in (tmp_path, root, root / "run", root / "run" / "steps"):  # parents of new dirs
        assert str(d) in synced
    assert any(TEMP_PREFIX in p for p in synced)  # the file itself, before the rename
    synced.clear()
    no_sync = LocalStorage(root, options=store.options.replace(fsync=False))
    no_sync.write("run/x", b"1")
    assert synced == []
    no_sync.commit("run/COMMIT", b"1")  # commit is always durable
    assert synced


def test_stale_listing_entry_is_skipped_counted_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listed name whose stat fails (as a stale NFS listing gives; a planted symlink is
    refused instead, see test_hostile_fs.py)."""
    store = LocalStorage(tmp_path)
    store.write("steps/1/COMMIT", b"ok")
    store.write("steps/1/rank_0.json", b"{}")
    real_stat = os.stat

    def stale_stat(path: object, *a: object, **kw: object) -> os.stat_result:
        if os.path.basename(str(path)) == "rank_0.json":
            raise FileNotFoundError(2, "stale", str(path))
        return real_stat(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", stale_stat)
    with caplog.at_level(logging.WARNING, logger="ckpt_agent.storage.fs"):
        assert [i.key for i in store.list()] == ["steps/1/COMMIT"]
    assert store.stale_entries == 1
    assert "stale listing" in caplog.text and "actimeo=0" in caplog.text


def test_stale_entry_that_recovers_on_relist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First stat fails (stale attribute cache), the re-read listing is fine."""
    store = LocalStorage(tmp_path)
    store.write("d/a", b"1")
    store.write("d/b", b"22")
    real_stat = os.stat
    failed: list[str] = []

    def flaky_stat(path: object, *a: object, **kw: object) -> os.stat_result:
        # the backend stats names relative to their folder's descriptor (dir_fd)
        if os.path.basename(str(path)) == "b" and not failed:
            failed.append(str(path))
            raise FileNotFoundError(2, "stale", str(path))
        return real_stat(path, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", flaky_stat)
    assert [(i.key, i.size) for i in store.list()] == [("d/a", 1), ("d/b", 2)]
    assert failed and store.stale_entries == 0


def test_urls_and_relative_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    a = open_storage("rel/dir")
    b = open_storage(f"file://{tmp_path}/rel/dir")
    c = open_storage(f"file://localhost{tmp_path}/rel/dir")
    assert isinstance(a, LocalStorage) and isinstance(b, LocalStorage)
    assert a.root == b.root == c.root == tmp_path / "rel" / "dir"  # type: ignore[attr-defined]
    assert a.url == (tmp_path / "rel" / "dir").as_uri()
    a.write("k", b"v")
    assert b.read("k") == b"v"
    sp = open_storage(f"file://{tmp_path}/with%20space")
    assert sp.root == tmp_path / "with space"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="host"):
        open_storage("file://nfs-server/export")
