"""Validation after write: re-read, load in a separate process, compare with the live model.

A committed checkpoint is ``pending`` until :meth:`Validator.validate` says
otherwise. The checks, in order:

1. **load** — every blob of the checkpoint is re-read from storage, its size
   and SHA-256 compared with the manifest, decoded (codec, shuffle) and the
   decoded bytes' SHA-256 compared too; the state tree must reference only
   tensors the manifest holds. By default this runs in a *separate process*
   (:class:`LoaderProcess`: a long-lived ``python -m ckpt_agent.persist.validate
   --serve`` child, torch-free: nothing is unpickled, a crash or hang there
   cannot take the trainer down and is reported as a failed load).
2. **shapes** — every tensor's dtype and shape is compared with the live
   state's metadata captured at snapshot time (missing, extra or different
   tensors are listed).

The verdict is written next to the COMMIT (``VALIDATION.json``, bound to the
COMMIT's hash) so that any reader — the operator, ``ckpt ls``, a restarted
trainer — sees it, unless the checkpoint changed while it was validated: its
COMMIT gone or replaced, or a final verdict (``expired``, ``corrupted``) stored
meanwhile (:mod:`ckpt_agent.persist.verdicts`). Corrupted checkpoints are never offered for
resume.

This module is torch-free so that the child process starts fast.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckpt_agent.background import lower_process_priority
from ckpt_agent.errors import IntegrityError, NotFoundError, StorageError, one_line
from ckpt_agent.format.chunkread import raw_check
from ckpt_agent.format.codec import CODEC_NONE, Shuffler
from ckpt_agent.format.layout import blob_key, sha256_hex
from ckpt_agent.format.readers import check_tensor_bytes, read_commit, read_rank_manifest
from ckpt_agent.format.shuffle import NUMPY_SHUFFLER
from ckpt_agent.format.statecheck import check_state
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.persist.verdicts import write_verdict
from ckpt_agent.policy.models import ValidationSpec
from ckpt_agent.records import CheckpointStatus, Json
from ckpt_agent.storage import open_storage
from ckpt_agent.storage.base import Storage

__all__ = [
    "LoadReport",
    "ValidationOutcome",
    "Validator",
    "compare_meta",
    "load_check",
    "main",
]

log = logging.getLogger(__name__)

TensorMeta = Mapping[str, tuple[str, tuple[int, ...]]]

#: Seconds the loader process may take before the checkpoint counts as unloadable.
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class LoadReport:
    """What the loader found (JSON-serializable for the child process)."""

    ok: bool = True
    error: str = ""
    manifest_hash: str = ""
    tensors: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    bad_blobs: list[str] = field(default_factory=list)
    bytes_read: int = 0

    def to_json(self) -> dict[str, Json]:
        return {
            "ok": self.ok,
            "error": self.error,
            "manifest_hash": self.manifest_hash,
            "tensors": {k: [d, list(s)] for k, (d, s) in self.tensors.items()},
            "bad_blobs": self.bad_blobs,
            "bytes_read": self.bytes_read,
        }

    @classmethod
    def from_json(cls, d: Json) -> LoadReport:
        if not isinstance(d, dict):
            raise ValueError("loader report is not an object")
        tensors = {
            str(k): (str(v[0]), tuple(int(x) for x in v[1]))
            for k, v in dict(d.get("tensors") or {}).items()
        }
        return cls(
            ok=bool(d.get("ok")),
            error=str(d.get("error") or ""),
            manifest_hash=str(d.get("manifest_hash") or ""),
            tensors=tensors,
            bad_blobs=[str(b) for b in d.get("bad_blobs") or []],
            bytes_read=int(d.get("bytes_read") or 0),
        )


def load_check(
    storage: Storage,
    run_id: str,
    ckpt_id: str,
    rank: int = 0,
    shuffler: Shuffler | None = None,
    *,
    mode: str = "full",
) -> LoadReport:
    """Decode every tensor, file and the whole state tree of one rank; never raises for bad data.

    The tree is decoded as a restore decodes it (:func:`~ckpt_agent.format.statecheck.check_state`),
    so what ``Checkpointer.start()`` would refuse is not called valid. Memory stays at one
    chunk whatever the manifest declares; a blob referenced many times is decoded once.
    With ``mode="stored"`` the blobs are re-read and their stored bytes hashed, not decoded
    (:class:`~ckpt_agent.policy.models.ValidationSpec`).
    """
    shuffler = shuffler or NUMPY_SHUFFLER
    report = LoadReport()
    try:
        committed = read_commit(storage, run_id, ckpt_id)
        report.manifest_hash = committed.manifest_hash
        manifest = read_rank_manifest(storage, run_id, committed, rank)
        check_state(manifest)
        seen: set[str] = set()
        for name, entry in (*manifest.tensors.items(), *manifest.files.items()):
            try:
                if mode == "stored":
                    what = f"{manifest.checkpoint_id}: {name!r}"
                    _check_stored(storage, run_id, manifest, entry.chunks, seen, what)
                else:
                    check_tensor_bytes(
                        storage, run_id, manifest, entry, name, seen=seen, shuffler=shuffler
                    )
            except IntegrityError:
                report.bad_blobs.extend(_bad_blobs(storage, run_id, manifest, entry.chunks))
                raise
            report.bytes_read += entry.nbytes
            if name in manifest.tensors:
                report.tensors[name] = (entry.dtype, entry.shape)
    except Exception as e:  # bad data of any kind is a failed load, reported, never a crash
        report.ok = False
        report.error = one_line(e)
    return report


def _check_stored(
    storage: Storage,
    run_id: str,
    manifest: Any,
    chunks: Sequence[str],
    seen: set[str],
    what: str,
) -> None:
    """Every chunk as stored has the manifest's size and the hash the writer recorded for
    those bytes: an uncompressed blob (stored bytes = raw bytes) by the raw check the
    restore makes (:func:`~ckpt_agent.format.chunkread.raw_check`: BLAKE3 where recorded),
    any other by its name, the SHA-256. The messages are the full check's."""
    for digest in chunks:
        if digest in seen:
            continue
        blob = manifest.blobs[digest]
        raw = blob.codec.codec == CODEC_NONE
        new, expected = raw_check(blob) if raw else (hashlib.sha256, digest)
        problem = ""
        try:
            with storage.read_view(blob_key(run_id, digest)) as b:
                if len(b) != blob.size:
                    problem = (
                        f"has {len(b)} bytes, manifest says {blob.size} (truncated or overwritten)"
                    )
                else:
                    h = new()
                    h.update(b)
                    if (got := h.hexdigest()) != expected:
                        problem = f"hashes to {got[:16]}… (corrupted bytes)"
        except NotFoundError:
            problem = "is missing from storage"
        if problem:
            raise IntegrityError(f"{what}: blob {digest[:16]}… {problem}")
        seen.add(digest)


def _bad_blobs(storage: Storage, run_id: str, manifest: Any, chunks: Sequence[str]) -> list[str]:
    """Which of ``chunks`` do not hash to their name (for self-healing)."""
    bad: list[str] = []
    for digest in chunks:
        try:
            with storage.read_view(blob_key(run_id, digest)) as b:
                if len(b) != manifest.blobs[digest].size or sha256_hex(b) != digest:
                    bad.append(digest)
        except StorageError:
            continue  # missing: nothing to delete
    return bad


def compare_meta(expected: TensorMeta, got: TensorMeta, *, prefix: str = "") -> list[str]:
    """Differences between live metadata and a checkpoint's (empty: identical)."""
    problems: list[str] = []
    exp = {k: v for k, v in expected.items() if k.startswith(prefix)}
    have = {k: v for k, v in got.items() if k.startswith(prefix)}
    for name in sorted(exp.keys() - have.keys()):
        problems.append(f"{name}: missing from the checkpoint")
    for name in sorted(have.keys() - exp.keys()):
        problems.append(f"{name}: in the checkpoint but not in the live state")
    for name in sorted(exp.keys() & have.keys()):
        (ed, es), (gd, gs) = exp[name], have[name]
        if ed != gd or tuple(es) != tuple(gs):
            problems.append(f"{name}: checkpoint has {gd}{list(gs)}, live state has {ed}{list(es)}")
    return problems


@dataclass
class ValidationOutcome:
    """The verdict on one checkpoint."""

    checkpoint_id: str
    status: CheckpointStatus
    reason: str = ""
    checks: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    manifest_hash: str = ""
    bad_blobs: list[str] = field(default_factory=list)
    bytes_read: int = 0
    expected_hash: str = ""
    """The COMMIT the caller asked to judge (its hash; empty: whatever was loaded). A
    verdict is recorded only while that COMMIT is the checkpoint's (:meth:`Validator.record`)."""

    @property
    def valid(self) -> bool:
        return self.status == CheckpointStatus.VALID


class LoaderProcess:
    """A long-lived ``python -m ckpt_agent.persist.validate --serve`` child.

    One JSON line in, one out.

    Started on first use (its interpreter start-up is paid once, not per
    checkpoint); a crashed or hung child is killed, reported as a failed load
    and replaced on the next request. It imports no torch and unpickles nothing.
    """

    def __init__(self, storage_url: str, *, env: Mapping[str, str] | None = None) -> None:
        self.storage_url = storage_url
        self.env = dict(os.environ if env is None else env)
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = dict(self.env)
        env["CKPT_VALIDATE_CHILD"] = "1"
        self.starts += 1
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ckpt_agent.persist.validate",
                "--serve",
                "--storage",
                self.storage_url,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def load(
        self, run_id: str, ckpt_id: str, rank: int, *, timeout: float, mode: str = "full"
    ) -> LoadReport:
        if self._proc is None or self._proc.poll() is not None:
            self._kill()  # a child that died on its own: reap it and close its pipes
            self._proc = self._spawn()
        proc = self._proc
        assert proc.stdin is not None and proc.stdout is not None
        request = {"run_id": run_id, "checkpoint": ckpt_id, "rank": rank, "mode": mode}
        line_out = json.dumps(request) + "\n"
        try:
            proc.stdin.write(line_out.encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            self._kill()
            return LoadReport(ok=False, error=f"loader process is gone: {e}")
        line = self._readline(proc, timeout)
        if line is None:
            code = proc.poll()
            self._kill()
            if code is None:
                return LoadReport(ok=False, error=f"loader process timed out after {timeout:g} s")
            return LoadReport(ok=False, error=f"loader process died (exit code {code})")
        try:
            return LoadReport.from_json(json.loads(line))
        except (ValueError, TypeError) as e:
            self._kill()
            return LoadReport(ok=False, error=f"unreadable loader report: {e}")

    @staticmethod
    def _readline(proc: subprocess.Popen[bytes], timeout: float) -> bytes | None:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if not sel.select(left):
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    return None
                buf += chunk
                if b"\n" in buf:
                    return buf.split(b"\n", 1)[0]

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def close(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.close()  # EOF: the child exits
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()


class Validator:
    """Runs the checks of a :class:`~ckpt_agent.policy.models.ValidationSpec` on checkpoints.

    ``env`` is the loader process's environment (default ``os.environ``): the child opens
    ``storage.url`` with the ``CKPT_S3_*``/``CKPT_FS_*`` options found there, so pass
    :meth:`StorageOptions.to_env() <ckpt_agent.storage.options.StorageOptions.to_env>` of the
    options the storage was opened with (:meth:`PersistBuilder.validator
    <ckpt_agent.persist.builder.PersistBuilder.validator>` does).
    """

    def __init__(
        self,
        storage: Storage,
        run_id: str,
        spec: ValidationSpec | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.storage = storage
        self.run_id = run_id
        self.spec = spec or ValidationSpec()
        self.timeout_s = timeout_s
        self.env = dict(os.environ if env is None else env)
        self._child: LoaderProcess | None = None
        self._child_lock = threading.Lock()

    def load(self, ckpt_id: str, rank: int = 0) -> LoadReport:
        if not self.spec.load_in_subprocess:
            return load_check(self.storage, self.run_id, ckpt_id, rank, mode=self.spec.mode)
        return self._load_in_child(ckpt_id, rank)

    def _load_in_child(self, ckpt_id: str, rank: int) -> LoadReport:
        with self._child_lock:
            if self._child is None:
                self._child = LoaderProcess(self.storage.url, env=self.env)
            return self._child.load(
                self.run_id, ckpt_id, rank, timeout=self.timeout_s, mode=self.spec.mode
            )

    def close(self) -> None:
        """Stop the loader process (if one was started)."""
        with self._child_lock:
            if self._child is not None:
                self._child.close()
                self._child = None

    def validate(
        self, ckpt_id: str, expected: TensorMeta | None = None, rank: int = 0
    ) -> ValidationOutcome:
        """Load (in a child process by default) and compare with ``expected``."""
        t0 = time.perf_counter()
        where = "load (subprocess)" if self.spec.load_in_subprocess else "load (in-process)"
        checks = ["hashes" if self.spec.mode == "full" else "stored hashes", where]
        report = self.load(ckpt_id, rank)
        outcome = ValidationOutcome(
            checkpoint_id=ckpt_id,
            status=CheckpointStatus.VALID,
            checks=checks,
            manifest_hash=report.manifest_hash,
            bad_blobs=list(report.bad_blobs),
            bytes_read=report.bytes_read,
        )
        if not report.ok:
            outcome.status = CheckpointStatus.CORRUPTED
            outcome.reason = report.error
        elif expected is not None and self.spec.check_shapes:
            checks.append("shapes")
            problems = compare_meta(expected, report.tensors)
            if problems:
                outcome.status = CheckpointStatus.CORRUPTED
                more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
                outcome.reason = (
                    "shape/dtype mismatch with the live model: " + "; ".join(problems[:3]) + more
                )
        outcome.duration_s = time.perf_counter() - t0
        return outcome

    def record(self, outcome: ValidationOutcome) -> bool:
        """Write the verdict next to the COMMIT, unless the checkpoint changed while it was
        validated (retired, deleted, re-saved: :func:`~ckpt_agent.persist.verdicts.write_verdict`;
        the COMMIT judged is :attr:`ValidationOutcome.expected_hash`, else the one loaded);
        returns whether the verdict in force is this one (False: the stored state stands)."""
        rec = ValidationVerdict(
            checkpoint_id=outcome.checkpoint_id,
            commit_sha256=outcome.manifest_hash,
            status=outcome.status,
            reason=outcome.reason,
            validated_at=time.time(),
            checks=tuple(outcome.checks),
            duration_s=outcome.duration_s,
        )
        judged = outcome.expected_hash or outcome.manifest_hash
        return write_verdict(self.storage, self.run_id, rec, judged)


# --------------------------------------------------------------------------- child process


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ckpt_agent.persist.validate``: load one checkpoint rank, print a JSON report."""
    p = argparse.ArgumentParser(
        prog="python -m ckpt_agent.persist.validate", description=main.__doc__
    )
    p.add_argument("--storage", required=True)
    p.add_argument("--run-id")
    p.add_argument("--checkpoint")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--serve", action="store_true", help="answer JSON-line requests on stdin")
    args = p.parse_args(argv)
    if args.serve:
        return _serve(args.storage)
    if not args.run_id or not args.checkpoint:
        p.error("--run-id and --checkpoint are required without --serve")
    try:
        storage = open_storage(args.storage)
        report = load_check(storage, args.run_id, args.checkpoint, args.rank)
    except Exception as e:  # a broken store is a failed load, reported as such
        report = LoadReport(ok=False, error=f"{type(e).__name__}: {e}")
    sys.stdout.write(json.dumps(report.to_json()) + "\n")
    sys.stdout.flush()
    return 0 if report.ok else 1


def _serve(url: str) -> int:
    lower_process_priority()  # a background process: the trainer's cores come first
    storage = open_storage(url)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            report = load_check(
                storage,
                str(req["run_id"]),
                str(req["checkpoint"]),
                int(req.get("rank", 0)),
                mode="stored" if req.get("mode") == "stored" else "full",
            )
        except Exception as e:  # a bad request or a broken store: a failed load
            report = LoadReport(ok=False, error=f"{type(e).__name__}: {e}")
        sys.stdout.write(json.dumps(report.to_json()) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
