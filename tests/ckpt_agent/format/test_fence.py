"""Writer generations: keys, bounded records, claims (races included) and the fence check."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckpt_agent.errors import CheckpointFormatError, FencedError
from ckpt_agent.format import fence as fence_mod
from ckpt_agent.format.fence import (
    RECORD_MAX_BYTES,
    Fence,
    WriterRecord,
    claim,
    generations,
    holder_of,
    parse_writer_name,
    read_writer,
    writer_key,
)
from ckpt_agent.storage.fs import LocalStorage

ENV = {
    "CKPT_NAMESPACE": "team-a",
    "CKPT_JOB_NAME": "llm",
    "CKPT_POD_NAME": "llm-worker-0",
    "CKPT_NODE_NAME": "gpu-17",
}


@pytest.fixture
def store(tmp_path: Path) -> LocalStorage:
    return LocalStorage(tmp_path / "root")


def test_keys_sort_numerically_and_names_parse_back() -> None:
    assert writer_key("r", 7) == "r/writers/000000000007.json"
    assert parse_writer_name("000000000007.json") == 7
    for bad in ("7.json", "000000000000.json", "00000000000x.json", "000000000007.tmp", "x"):
        assert parse_writer_name(bad) is None
    with pytest.raises(ValueError):
        writer_key("r", 0)


def test_record_round_trips_and_is_bounded_and_clean() -> None:
    rec = WriterRecord.here(3, ENV)
    back = WriterRecord.from_bytes(rec.to_bytes(), "w")
    assert back == rec
    assert (back.namespace, back.job, back.pod, back.node) == (
        "team-a",
        "llm",
        "llm-worker-0",
        "gpu-17",
    )
    assert (
        "generation 3: pod llm-worker-0 on node gpu-17 in namespace team-a (job llm)"
        in rec.describe()
    )
    hostile = json.dumps({"generation": 2, "pod": "\x1b]0;x\x07" + "p" * 999, "pid": True}).encode()
    parsed = WriterRecord.from_bytes(hostile, "w")
    assert parsed.pod.isprintable() and len(parsed.pod) <= 253 and parsed.pid == 0
    for bad in (
        b"[]",
        b'{"generation": 0}',
        b'{"generation": true}',
        b"x" * (RECORD_MAX_BYTES + 1),
    ):
        with pytest.raises(CheckpointFormatError):
            WriterRecord.from_bytes(bad, "w")


def test_claims_are_dense_and_the_highest_holds(store: LocalStorage) -> None:
    first = claim(store, "r", environ=ENV)
    second = claim(store, "r", environ=ENV)
    assert (first.generation, second.generation) == (1, 2)
    assert generations(store, "r") == [1, 2]
    holder = holder_of(store, "r")
    assert holder is not None and holder.nonce == second.record.nonce
    assert read_writer(store, "r", 1) == first.record
    store.commit("r/writers/notes.txt", b"ignored")
    assert generations(store, "r") == [1, 2]


def test_concurrent_claims_get_distinct_generations(store: LocalStorage) -> None:
    with ThreadPoolExecutor(8) as pool:
        fences = list(pool.map(lambda _: claim(store, "r", environ=ENV), range(8)))
    assert sorted(f.generation for f in fences) == list(range(1, 9))


def test_a_lost_race_claims_the_next_generation(
    store: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fence_mod.generations
    calls = {"n": 0}

    def stale(storage: LocalStorage, run_id: str) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 1:  # the first listing misses a claim made meanwhile
            claim(store, "r", environ=ENV)
            return []
        return real(storage, run_id)

    monkeypatch.setattr(fence_mod, "generations", stale)
    assert claim(store, "r", environ=ENV).generation == 2


def test_check_fences_once_a_newer_generation_exists_and_stays_fenced(store: LocalStorage) -> None:
    old = claim(store, "r", environ=ENV)
    old.check()  # holds
    assert old.fenced is None
    newer = claim(
        store,
        "r",
        environ={**ENV, "CKPT_POD_NAME": "llm-worker-0-retry", "CKPT_NODE_NAME": "gpu-3"},
    )
    with pytest.raises(FencedError) as ei:
        old.check()
    msg = str(ei.value)
    assert "generation 2: pod llm-worker-0-retry on node gpu-3 in namespace team-a" in msg
    assert "holds generation 1" in msg and "Stop this process" in msg
    assert ei.value.generation == 1
    store.delete_prefix("r/writers/")  # even if the claims vanish: fenced is sticky
    with pytest.raises(FencedError):
        old.check()
    newer.check()


def test_an_unreadable_newer_claim_still_fences(store: LocalStorage) -> None:
    old = claim(store, "r", environ=ENV)
    store.commit(writer_key("r", 2), b"garbage")
    with pytest.raises(FencedError, match="generation 2"):
        old.check()


def test_a_fence_object_checks_with_one_stat(store: LocalStorage) -> None:
    f = Fence(store, "r", WriterRecord(generation=5))
    f.check()  # nothing newer: no claim files at all


def test_a_claimant_without_a_checkpointer_reports_being_fenced(
    store: LocalStorage, tmp_path: Path
) -> None:
    """The flash sidecar and the DCP writer claim without a checkpointer's report: the
    container's termination log (CKPT_TERMINATION_LOG) still says fenced, naming the holder,
    and keeps the checkpoints it reported (#28)."""
    from ckpt_agent.format.termination import CheckpointReport, encode_report, parse_report
    from ckpt_agent.policy.models import Tier
    from ckpt_agent.records import CheckpointRecord, CheckpointStatus

    term = tmp_path / "termination-log"
    valid = CheckpointRecord(
        id="pulse_step_000000000010",
        step=10,
        tier=Tier.PULSE,
        status=CheckpointStatus.VALID,
        created_at=5.0,
        manifest_hash="ab" * 32,
    )
    term.write_bytes(encode_report(CheckpointReport.from_records("r", [valid], 6.0)))
    old = claim(store, "r", environ={**ENV, "CKPT_TERMINATION_LOG": str(term)})
    assert claim(store, "r", environ={"CKPT_POD_NAME": "new-0"}).on_fenced is None  # no log
    for _ in range(2):
        with pytest.raises(FencedError):
            old.check()
    report = parse_report(term.read_text())
    assert report.fenced is not None
    assert (report.fenced.generation, report.fenced.holder, report.fenced.pod) == (1, 2, "new-0")
    assert [c.step for c in report.checkpoints] == [10]


def _pod(uid: str, name: str) -> dict[str, str]:
    return {**ENV, "CKPT_POD_NAME": name, "CKPT_POD_UID": uid}


def test_a_fenced_pod_restarted_in_place_never_claims_the_run_back(
    store: LocalStorage, tmp_path: Path
) -> None:
    """restartPolicy OnFailure: the zombie's container restarts in place (same pod uid)
    after it was fenced; claiming again would fence the holder, and two pods would take
    the run from each other forever. It is refused, naming the holder, and the
    termination report says fenced; the holder keeps the run."""
    from ckpt_agent.format.termination import parse_report

    term = tmp_path / "termination-log"
    zombie = claim(store, "r", environ=_pod("uid-a", "llm-worker-0"))
    holder = claim(store, "r", environ=_pod("uid-b", "llm-r1-worker-0"))
    with pytest.raises(FencedError):
        zombie.check()
    env = {**_pod("uid-a", "llm-worker-0"), "CKPT_TERMINATION_LOG": str(term)}
    with pytest.raises(FencedError, match="llm-r1-worker-0") as refused:
        claim(store, "r", environ=env)
    assert refused.value.generation == 1
    assert generations(store, "r") == [1, 2]  # nothing claimed
    holder.check()  # still holds
    report = parse_report(term.read_text())
    assert report.fenced is not None
    assert (report.fenced.generation, report.fenced.holder) == (1, 2)


def test_the_holders_own_restart_and_new_pods_claim_as_usual(store: LocalStorage) -> None:
    """The holder's container restarting in place (its pod holds the highest claim), a
    new pod of a restarted job, and a process outside Kubernetes (no pod uid) claim."""
    claim(store, "r", environ=_pod("uid-a", "w-0"))
    assert claim(store, "r", environ=_pod("uid-a", "w-0")).generation == 2  # in place
    assert claim(store, "r", environ=_pod("uid-b", "w-r1-0")).generation == 3  # new pod
    assert claim(store, "r", environ=ENV).generation == 4  # no uid: no rule
    # uid-a lost to uid-b, then b lost to a uid-less process: a's retake is still refused
    with pytest.raises(FencedError):
        claim(store, "r", environ=_pod("uid-a", "w-0"))
    assert claim(store, "r", environ=_pod("uid-c", "w-r2-0")).generation == 5


def test_an_unreadable_newest_claim_leaves_no_rule_to_apply(store: LocalStorage) -> None:
    """Who holds the run cannot be told: the retake check does not refuse (as before it)."""
    claim(store, "r", environ=_pod("uid-a", "w-0"))
    claim(store, "r", environ=_pod("uid-b", "w-r1-0"))
    store.commit(writer_key("r", 3), b"not json")  # a newest claim nobody can read
    assert claim(store, "r", environ=_pod("uid-a", "w-0")).generation == 4
