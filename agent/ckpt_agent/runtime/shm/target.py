"""The trainer's side of flash checkpoints: snapshot into shared memory, a persister does the rest.

:class:`FlashTarget` owns this rank's :class:`~ckpt_agent.runtime.shm.writer.ShmWriter` and
makes sure a persister serves it: the pod's sidecar container (the operator
injects it when ``spec.agent.sidecar`` is true) or, for a local run, a
subprocess ``python -m ckpt_agent.cli sidecar --exit-with-trainer`` started in
its own session, so that it outlives a SIGKILL of the trainer, persists the
last complete snapshot, and exits.

The engine (:class:`~ckpt_agent.runtime.checkpointer.Checkpointer`) calls :meth:`write`
instead of copying into host buffers, reads the persister's results with
:meth:`poll` (errors, commit hashes, persist times for the scheduler: every save's), and
waits with :meth:`wait` where it used to wait for its persister thread. An
in-place restart reads the areas back (:mod:`~ckpt_agent.runtime.shm.in_place`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from ckpt_agent import tuning
from ckpt_agent.flash.protocol import DEFAULT_SLOTS, Descriptor, PersistedMark, read_health
from ckpt_agent.flash.reader import ShmReader
from ckpt_agent.flash.replica.rehydrate import (
    RehydrateAnswer,
    advertised,
    read_answer,
    write_request,
)
from ckpt_agent.policy.agent_config import AgentConfig
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import Json
from ckpt_agent.runtime.shm.writer import ShmWriter

__all__ = ["FlashTarget"]

log = logging.getLogger(__name__)


class FlashTarget:
    """Shared-memory snapshots of one rank plus the persister that serves them."""

    def __init__(
        self,
        config: AgentConfig,
        rank: int,
        world_size: int,
        *,
        work_dir: str | Path,
        local_persister: bool | None = None,
        slots: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``slots`` (None: :data:`DEFAULT_SLOTS`, one more with the memory tier, so that
        memory snapshots go on while the persister holds a durable one)."""
        if not config.shm_dir:
            raise ValueError("config.shm_dir is not set")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.work_dir = Path(work_dir)
        if slots is None:
            slots = DEFAULT_SLOTS + (1 if config.tiers.memory.enabled else 0)
        self.slots = slots
        self.local_persister = (
            not config.agent.sidecar if local_persister is None else local_persister
        )
        self.env = dict(os.environ if env is None else env)
        self.writer: ShmWriter | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen_seq = 0
        self._seen_file: tuple[int, int, int] | None = None
        """(inode, mtime ns, size) of ``persisted.json`` at the last poll: the persister
        replaces the file, so an unchanged stat means nothing new (no read, no parse)."""
        self._last_seq = 0
        self._gpu_seen: int | None = None
        self._health_checked = 0.0
        self._health: tuple[int | None, float | None] = (None, None)

    @property
    def reader(self) -> ShmReader:
        return self.reader_of(self.rank)

    def reader_of(self, rank: int) -> ShmReader:
        """A reader of ``rank``'s area on this node (it may not exist)."""
        assert self.config.shm_dir
        return ShmReader(self.config.shm_dir, self.config.run_id, rank, slots=self.slots)

    # ------------------------------------------------------------------ lifecycle

    def flush_previous(self, timeout: float | None = None) -> PersistedMark | None:
        """Before resuming: let a persister handle complete snapshots a dead trainer left.

        Starts the local persister first when there is none (local mode). ``timeout``
        (None: :data:`~ckpt_agent.tuning.SHM_FLUSH_TIMEOUT_S`). Returns the persister's
        newest mark (None if there was nothing to do or it did not finish in time).
        """
        r = self.reader
        latest = r.latest()
        mark = r.persisted()
        if latest is None or (mark is not None and mark.seq >= latest.seq):
            return mark
        if r.trainer_alive():
            return mark  # a live trainer owns the area (the writer will refuse to start)
        if not r.persister_alive() and self.local_persister:
            self._spawn()
        deadline = time.monotonic() + (tuning.SHM_FLUSH_TIMEOUT_S if timeout is None else timeout)
        while time.monotonic() < deadline:
            mark = r.persisted()
            if mark is not None and mark.seq >= latest.seq:
                return mark
            if not r.persister_alive() and self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.02)
        log.warning(
            "no persister handled snapshot seq %d of rank %d in time", latest.seq, self.rank
        )
        return r.persisted()

    def rehydrate(self) -> RehydrateAnswer | None:
        """Before resuming on a node that does not hold this rank's snapshot (the rank's node
        was lost and its pod recreated elsewhere): ask the pod's sidecar for the newest
        replica its peers hold (:mod:`ckpt_agent.flash.replica.rehydrate`); the in-place
        restart then offers it like any snapshot.

        Only with a sidecar (not a local persister) that advertises it answers (an older
        one does not), and an area without a snapshot. Waits
        :data:`~ckpt_agent.tuning.REHYDRATE_CLAIM_S` for such a sidecar and for it to take
        the area, then :data:`~ckpt_agent.tuning.REHYDRATE_TIMEOUT_S` for its answer (None:
        no such sidecar, or no answer in time: resume as without it)."""
        r = self.reader
        if self.local_persister or r.latest() is not None:
            return None
        assert self.config.shm_dir
        t0 = time.monotonic()
        claim_by, answer_by = t0 + tuning.REHYDRATE_CLAIM_S, t0 + tuning.REHYDRATE_TIMEOUT_S
        while not advertised(self.config.shm_dir, self.config.run_id):
            if time.monotonic() > claim_by:
                return None
            time.sleep(0.02)
        nonce = secrets.token_hex(8)
        write_request(r, nonce)
        claim_by = time.monotonic() + tuning.REHYDRATE_CLAIM_S  # the sidecar takes the area
        while time.monotonic() < answer_by:
            answer = read_answer(r, nonce)
            if answer is not None:
                return answer
            if not r.persister_alive() and time.monotonic() > claim_by:
                log.info("no sidecar took rank %d's area: resuming without a replica", self.rank)
                return None
            time.sleep(0.02)
        log.warning("the sidecar did not answer rank %d's request for a replica in time", self.rank)
        return None

    def start(self) -> None:
        """Take this rank's area (trainer lock) and make sure a persister serves it."""
        assert self.config.shm_dir
        self.writer = ShmWriter(
            self.config.shm_dir,
            self.config.run_id,
            self.rank,
            world_size=self.world_size,
            slots=self.slots,
        )
        mark = self.writer.persisted()
        self._seen_seq = mark.seq if mark is not None else 0
        no_proc = self.proc is None or self.proc.poll() is not None
        if self.local_persister and no_proc and not self.writer.persister_alive():
            self._spawn()
            self.wait_persister(tuning.SHM_PERSISTER_START_TIMEOUT_S)

    def wait_persister(self, timeout: float) -> bool:
        """Wait until a persister serves this area (it holds ``persister.lock``)."""
        r = self.reader
        deadline = time.monotonic() + timeout
        while not r.persister_alive():
            if time.monotonic() >= deadline or (
                self.proc is not None and self.proc.poll() is not None
            ):
                log.warning("no persister serves rank %d's shared-memory area yet", self.rank)
                return False
            time.sleep(0.01)
        return True

    def _spawn(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        cfg = self.work_dir / f"sidecar-config.rank{self.rank}.json"
        tmp = cfg.with_suffix(".tmp")
        tmp.write_text(self.config.to_json())
        os.replace(tmp, cfg)
        log_path = self.work_dir / f"sidecar.rank{self.rank}.log"
        env = dict(self.env)
        env.pop("CKPT_METRICS_PORT", None)
        cmd = [
            sys.executable,
            "-m",
            "ckpt_agent.cli",
            "sidecar",
            "--config",
            str(cfg),
            "--rank",
            str(self.rank),
            "--exit-with-trainer",
            "--metrics-port",
            "0",
        ]
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,  # survives a SIGKILL of the trainer's process group
                close_fds=True,
            )
        (self.work_dir / f"sidecar.rank{self.rank}.pid").write_text(f"{self.proc.pid}\n")
        log.info("started the local persister (pid %d) for rank %d", self.proc.pid, self.rank)

    def close(self, timeout: float | None = 60.0) -> bool:
        """Release the area; in local mode wait for the persister to finish. False on timeout."""
        if self.writer is not None:
            self.writer.close()  # frees trainer.lock: the local persister drains and exits
            self.writer = None
        proc, self.proc = self.proc, None
        if proc is None:
            return True
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the local persister (pid %d) is still running", proc.pid)
            return False
        return True

    # ------------------------------------------------------------------ saving

    @property
    def busy(self) -> bool:
        """No slot is free (the persister still owns them): defer or wait."""
        assert self.writer is not None
        return self.writer.busy

    def wait_free(self, timeout: float | None = None) -> bool:
        assert self.writer is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.002
        while self.writer.busy:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._check_persister()
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)
        return True

    def write(
        self,
        step: int,
        tier: Tier,
        sections: Mapping[str, object],
        *,
        files: Mapping[str, bytes] | None = None,
        meta: Mapping[str, Json] | None = None,
    ) -> Descriptor | None:
        assert self.writer is not None
        desc = self.writer.write(step, tier, sections, files=files, meta=meta)
        if desc is not None:
            self._last_seq = desc.seq
        return desc

    def prepare(self, sections: Mapping[str, object], files_bytes: int = 0) -> int:
        """Allocate and map the slots for a state like ``sections`` (before training)."""
        assert self.writer is not None
        return self.writer.prepare(sections, files_bytes=files_bytes)

    def poll(self) -> list[PersistedMark]:
        """The persister's results since the last call, oldest first (every save's, up to
        :data:`~ckpt_agent.flash.protocol.MARK_HISTORY` of them)."""
        assert self.writer is not None
        try:
            st = os.stat(self.writer.persisted_path)
            stamp: tuple[int, int, int] | None = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp is not None and stamp == self._seen_file:  # every step: a stat, no parse
            self._check_persister()
            return []
        self._seen_file = stamp
        mark = self.writer.persisted()
        if mark is None or mark.seq <= self._seen_seq:
            self._check_persister()
            return []
        new = mark.after(self._seen_seq)
        self._seen_seq = mark.seq
        return new

    def wait(self, seq: int | None = None, timeout: float | None = None) -> PersistedMark | None:
        """Wait until snapshot ``seq`` (default: the last written) was handled; None on timeout."""
        assert self.writer is not None
        seq = self._last_seq if seq is None else seq
        if seq <= 0:
            return self.writer.persisted()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            mark = self.writer.wait_persisted(seq, timeout=min(left, 1.0) if left else 1.0)
            if mark is not None:
                return mark
            self._check_persister()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _check_persister(self) -> None:
        """Local mode: restart a persister that died (it is stateless)."""
        if not self.local_persister or self.writer is None:
            return
        if self.proc is not None and self.proc.poll() is not None:
            log.warning("the local persister exited (code %s): restarting it", self.proc.returncode)
            self.proc = None
        if self.proc is None and not self.writer.persister_alive():
            self._spawn()

    @property
    def last_seq(self) -> int:
        return self._last_seq

    # ------------------------------------------------------------------ system signals

    def system_signals(self, max_age_s: float = 60.0) -> tuple[int | None, float | None]:
        """(new GPU errors since the last call, storage write latency ms) from the sidecar."""
        now = time.monotonic()
        if now - self._health_checked < 1.0:
            return None, self._health[1]
        self._health_checked = now
        assert self.config.shm_dir
        h = read_health(self.config.shm_dir, self.config.run_id)
        if h is None or time.time() - float(h.get("time") or 0) > max_age_s:
            self._health = (None, None)
            return None, None
        total = h.get("gpu_errors_total")
        delta: int | None = None
        if isinstance(total, int):
            delta = 0 if self._gpu_seen is None else max(0, total - self._gpu_seen)
            self._gpu_seen = total
        lat = h.get("write_latency_ms")
        latency = float(lat) if isinstance(lat, int | float) else None
        self._health = (delta, latency)
        return delta, latency

    def __enter__(self) -> FlashTarget:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.close()
