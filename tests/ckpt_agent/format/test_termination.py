"""The termination-message checkpoint report: format, size bound, parse errors, writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_agent.errors import CheckpointFormatError, TerminationReportError
from ckpt_agent.format.termination import (
    ENV_PATH,
    FORMAT,
    MAX_BYTES,
    VERSION,
    CheckpointReport,
    FencedReport,
    ReportedCheckpoint,
    TerminationLog,
    encode_report,
    merge_checkpoints,
    parse_report,
)
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, checkpoint_id

RUN = "run-0123456789abcdef"


def rec(
    step: int,
    tier: Tier = Tier.PULSE,
    status: CheckpointStatus = CheckpointStatus.VALID,
    **kw: object,
) -> CheckpointRecord:
    return CheckpointRecord(
        id=checkpoint_id(tier, step),
        step=step,
        tier=tier,
        status=status,
        created_at=1_764_500_000.0 + step,
        manifest_hash=f"{step:064x}",
        **kw,  # type: ignore[arg-type]
    )


def test_round_trip_keeps_what_the_ladder_needs() -> None:
    records = [
        rec(10, Tier.FULL),
        rec(20, prev_hash=f"{10:064x}"),
        rec(25, lightweight=True, approximate=True, emergency=True),
        rec(26, Tier.HEARTBEAT),
    ]
    report = CheckpointReport.from_records(RUN, records, 1_764_500_100.5)
    data = encode_report(report)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    back = parse_report(data)
    assert back == report
    assert back.run_id == RUN and back.written_at == 1_764_500_100.5
    assert [c.id for c in back.checkpoints] == [
        "heartbeat_step_000000000026",
        "pulse_step_000000000025",
        "pulse_step_000000000020",
        "full_step_000000000010",
    ]
    out = {r.id: r for r in back.records()}
    assert [r.step for r in back.records()] == [10, 20, 25, 26]  # oldest first, like listing
    lw = out["pulse_step_000000000025"]
    assert lw.lightweight and lw.approximate and lw.emergency and lw.status == "valid"
    # hashes are shortened consistently, so the prev chain still links
    assert out["pulse_step_000000000020"].prev_hash == out["full_step_000000000010"].manifest_hash
    assert out["full_step_000000000010"].tier == Tier.FULL
    assert out["full_step_000000000010"].created_at == 1_764_500_010.0


def test_only_verdicts_are_reported_corrupted_ones_with_their_time() -> None:
    records = [
        rec(1),
        rec(2, status=CheckpointStatus.PENDING),
        rec(3, status=CheckpointStatus.CORRUPTED),
        rec(4, status=CheckpointStatus.EXPIRED),
    ]
    report = CheckpointReport.from_records(RUN, records, 1_764_600_000.25)
    assert [(c.step, c.status) for c in report.checkpoints] == [(3, "corrupted"), (1, "valid")]
    bad, good = report.checkpoints
    assert bad.verdict_at == 1_764_600_000.25 and good.verdict_at == 0.0
    line = encode_report(report).decode()
    assert line.count('"vt":') == 1  # a valid entry carries no verdict time
    back = parse_report(line)
    assert back == report
    out = {r.step: r for r in back.records()}
    assert out[3].status == CheckpointStatus.CORRUPTED and out[3].extra["status_reason"]
    assert out[1].status == CheckpointStatus.VALID and not out[1].extra


def test_a_corrupted_verdict_replaces_the_valid_report_of_the_same_commit() -> None:
    valid = CheckpointReport.from_records(RUN, [rec(5)], 100.0).checkpoints
    bad = CheckpointReport.from_records(
        RUN, [rec(5, status=CheckpointStatus.CORRUPTED)], 200.0
    ).checkpoints
    # whatever order the reports come in: the commit time is the same, the verdict decides
    for groups in ((valid, bad), (bad, valid)):
        (merged,) = merge_checkpoints(*groups)
        assert merged.status == CheckpointStatus.CORRUPTED and merged.verdict_at == 200.0
    # the same step id committed again later (a rewritten checkpoint) is the new one
    again = ReportedCheckpoint(
        5, Tier.PULSE, CheckpointStatus.VALID, rec(5).created_at + 50, f"{6:064x}"
    )
    (merged,) = merge_checkpoints(bad, [again])
    assert merged == again


def test_corrupted_verdicts_stay_under_the_bound_and_keep_the_newest() -> None:
    records = [
        rec(
            s,
            status=CheckpointStatus.CORRUPTED if s % 3 else CheckpointStatus.VALID,
            prev_hash=f"{s - 1:064x}",
            lightweight=s % 2 == 0,
            emergency=True,
        )
        for s in range(1, 1001)
    ]
    report = CheckpointReport.from_records(RUN, records, 1_764_600_000.123)
    data = encode_report(report)
    assert len(data) <= MAX_BYTES < 4096
    back = parse_report(data)
    steps = [c.step for c in back.checkpoints]
    assert steps == list(range(1000, 1000 - len(steps), -1)) and len(steps) >= 8
    assert {c.status for c in back.checkpoints} == {"valid", "corrupted"}
    assert all(c.verdict_at for c in back.checkpoints if c.status == "corrupted")
    assert back.covers(1000) and not back.covers(steps[-1])


def test_covers_the_steps_after_its_oldest_entry() -> None:
    report = CheckpointReport.from_records(RUN, [rec(10, Tier.FULL), rec(20)])
    assert report.covers(11) and report.covers(30) and not report.covers(10)
    assert not CheckpointReport(RUN).covers(5)  # an empty report says nothing


def test_many_checkpoints_stay_under_the_bound_and_keep_the_newest() -> None:
    records = [rec(s, prev_hash=f"{s - 1:064x}") for s in range(1, 1001)]
    report = CheckpointReport.from_records(RUN, records)
    data = encode_report(report)
    assert len(data) <= MAX_BYTES < 4096  # the kubelet keeps 4096 bytes per container
    back = parse_report(data)
    steps = [c.step for c in back.checkpoints]
    assert steps[0] == 1000  # the newest survives
    assert steps == list(range(1000, 1000 - len(steps), -1))  # a contiguous newest run
    assert len(steps) >= 10
    # one more entry would not have fitted
    bigger = CheckpointReport(RUN, report.checkpoints[: len(steps) + 1])
    assert len(encode_report(bigger, max_bytes=10**6)) > MAX_BYTES


def test_smaller_bound_drops_more() -> None:
    report = CheckpointReport.from_records(RUN, [rec(s) for s in range(50)])
    small = parse_report(encode_report(report, max_bytes=600))
    assert 0 < len(small.checkpoints) < 10
    assert small.checkpoints[0].step == 49


def test_a_run_id_too_long_for_the_bound_is_refused_clearly() -> None:
    with pytest.raises(TerminationReportError, match="shorter run id"):
        encode_report(CheckpointReport("x" * 3000))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "empty"),
        ("\n\n", "empty"),
        ("Error: CUDA out of memory", "not JSON"),
        ('{"hello": 1}', "no format"),
        ('["a"]', "no format"),
        (f'{{"format":"{FORMAT}","v":99,"run":"r","cps":[]}}', "version 99 is not supported"),
        (f'{{"format":"{FORMAT}","v":{VERSION},"cps":[]}}', "without a run id"),
        (f'{{"format":"{FORMAT}","v":{VERSION},"run":"r","cps":{{}}}}', "not a list"),
        (f'{{"format":"{FORMAT}","v":{VERSION},"run":"r","cps":[1]}}', "not a map"),
        (
            f'{{"format":"{FORMAT}","v":{VERSION},"run":"r","cps":[{{"s":1,"t":"pulse","at":1}}]}}',
            "missing field 'st'",
        ),
        (
            f'{{"format":"{FORMAT}","v":{VERSION},"run":"r",'
            '"cps":[{"s":-1,"t":"pulse","st":"valid","at":1}]}',
            "non-negative",
        ),
        (
            f'{{"format":"{FORMAT}","v":{VERSION},"run":"r",'
            '"cps":[{"s":1,"t":"giant","st":"valid","at":1}]}',
            "giant",
        ),
        (
            f'{{"format":"{FORMAT}","v":{VERSION},"run":"r",'
            '"cps":[{"s":1,"t":"pulse","st":"valid","at":"noon"}]}',
            "not a number",
        ),
        # hostile or broken messages (well within the kubelet's 4096 bytes)
        ("[" * 3000, "nested too deep"),
        ("{" * 3000, "nested too deep|not JSON"),
        (f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[{"[" * 1500}{"]" * 1500}]}}', "deep"),
        ('{"a":' * 1500 + "1" + "}" * 1500, "nested too deep"),
        ("[" * 100_000, "100000 characters"),
        ('"' + "x" * 20_000 + '"', "characters"),
        ("9" * 5000, "not JSON"),  # past Python's int digit limit
        (f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[],"at":NaN}}', "not JSON"),
        (f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[],"at":1e400}}', "not finite"),
        (
            f'{{"format":"{FORMAT}","v":1,"run":"r",'
            '"cps":[{"s":1,"t":"pulse","st":"valid","at":1e400}]}',
            "not finite",
        ),
        (
            f'{{"format":"{FORMAT}","v":1,"run":"r",'
            '"cps":[{"s":1,"t":"pulse","st":"corrupted","at":1,"vt":"later"}]}',
            "not a number",
        ),
        (
            f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[{{"s":1,"t":[],"st":"valid","at":1}}]}}',
            "bad checkpoint entry",
        ),
        (
            f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[{{"s":1,"t":"pulse","st":{{}},"at":1}}]}}',
            "bad checkpoint entry",
        ),
        (
            f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[{{"s":1,"t":"pulse","st":"valid","at":1,"h":7}}]}}',
            "strings",
        ),
        (
            f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[{{"s":true,"t":"pulse","st":"valid","at":1}}]}}',
            "non-negative",
        ),
        (
            f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[{{"s":1,"t":"pulse","st":"valid","at":1,"f":[1]}}]}}',
            "flags",
        ),
        (f'{{"format":"{FORMAT}","v":1,"run":{{"x":1}},"cps":[]}}', "without a run id"),
        ("\ud800\udfff garbage", "not JSON"),
    ],
)
def test_parse_errors_say_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(TerminationReportError, match=match) as info:
        parse_report(text)
    assert isinstance(info.value, CheckpointFormatError)  # one family: decide on types


def test_a_long_bad_entry_is_quoted_short() -> None:
    entry = '{"s":1,"t":"pulse","st":"valid","at":"' + "x" * 1000 + '"}'
    with pytest.raises(TerminationReportError) as info:
        parse_report(f'{{"format":"{FORMAT}","v":1,"run":"r","cps":[{entry}]}}')
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("blob", [b"\xff\xfe\x00" * 100, bytes(range(256)) * 10])
def test_bytes_that_are_no_text_are_a_report_error(blob: bytes) -> None:
    with pytest.raises(TerminationReportError):
        parse_report(blob)


def test_stale_bytes_after_the_first_line_are_ignored() -> None:
    new = encode_report(CheckpointReport.from_records(RUN, [rec(5)]))
    old = encode_report(CheckpointReport.from_records(RUN, [rec(s) for s in range(5)]))
    torn = new + old[len(new) :]  # killed between the write and the truncate
    assert parse_report(torn).checkpoints[0].step == 5
    assert len(parse_report(torn).checkpoints) == 1


def test_merge_is_a_union_newest_first_later_commit_wins() -> None:
    a = ReportedCheckpoint(5, Tier.PULSE, CheckpointStatus.VALID, 100.0, "aa")
    b = ReportedCheckpoint(5, Tier.PULSE, CheckpointStatus.VALID, 200.0, "bb")
    c = ReportedCheckpoint(7, Tier.HEARTBEAT, CheckpointStatus.VALID, 150.0)
    d = ReportedCheckpoint(7, Tier.FULL, CheckpointStatus.VALID, 160.0)
    merged = merge_checkpoints([a, c], [b, d])
    assert [(m.step, m.tier) for m in merged] == [(7, Tier.FULL), (7, Tier.HEARTBEAT), (5, "pulse")]
    assert merged[2].manifest_hash == "bb"


def test_writer_rewrites_in_place(tmp_path: Path) -> None:
    path = tmp_path / "termination-log"
    log = TerminationLog(path)
    log.write(RUN, [rec(s) for s in range(30)])
    first = path.read_bytes()
    log.write(RUN, [rec(40)])
    second = path.read_bytes()
    assert len(second) < len(first)  # truncated, not just overwritten
    assert [c.step for c in parse_report(second).checkpoints] == [40]
    assert not log.failed


def test_writer_failure_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = TerminationLog(tmp_path / "missing" / "termination-log")
    log.write(RUN, [rec(1)])
    log.write(RUN, [rec(2)])
    assert log.failed
    assert sum("cannot write the checkpoint report" in r.message for r in caplog.records) == 1


def test_from_env(tmp_path: Path) -> None:
    path = tmp_path / "t"
    assert TerminationLog.from_env({ENV_PATH: str(path)}).path == str(path)  # type: ignore[union-attr]
    assert TerminationLog.from_env({ENV_PATH: ""}) is None
    # no variable: the Kubernetes default only when the kubelet created it (never created here)
    default = TerminationLog.from_env({})
    assert default is None or Path(default.path).is_file()


def test_a_fenced_report_round_trips_within_the_bound_with_long_names() -> None:
    """A fenced exit (#28) is told by the report: the holder's generation, pod, node."""
    fenced = FencedReport(3, 4, "p" * 400, "n" * 400, 1_764_500_000.5)
    report = CheckpointReport.from_records(RUN, [rec(s) for s in range(100)], 1.0)
    report = CheckpointReport(RUN, report.checkpoints, 1.0, fenced)
    data = encode_report(report)
    assert len(data) <= MAX_BYTES
    back = parse_report(data)
    assert back.fenced == FencedReport(3, 4, "p" * 253, "n" * 253, 1_764_500_000.5)
    assert back.checkpoints  # the newest checkpoints still fit
    assert parse_report(encode_report(CheckpointReport(RUN, (), 1.0))).fenced is None


@pytest.mark.parametrize(
    ("fenced", "match"),
    [
        ('"x"', "not a map"),
        ("{}", "missing field"),
        ('{"g": -1}', "non-negative"),
        ('{"g": true}', "non-negative"),
        ('{"g": 1, "pod": 5}', "strings"),
        ('{"g": 1, "at": "x"}', "not a number"),
    ],
)
def test_a_bad_fenced_entry_is_a_report_error(fenced: str, match: str) -> None:
    text = f'{{"format": "{FORMAT}", "v": {VERSION}, "run": "r", "cps": [], "fenced": {fenced}}}'
    with pytest.raises(TerminationReportError, match=match):
        parse_report(text)


def test_mark_fenced_keeps_the_last_checkpoints_of_the_same_run(tmp_path: Path) -> None:
    log = TerminationLog(tmp_path / "term")
    log.write(RUN, [rec(5)])
    log.mark_fenced(RUN, FencedReport(1, 2, "pod-b", "node-b", 2.0))
    back = parse_report((tmp_path / "term").read_text())
    assert [c.step for c in back.checkpoints] == [5] and back.fenced is not None
    log.mark_fenced("other", FencedReport(1, 2))
    back = parse_report((tmp_path / "term").read_text())
    assert back.run_id == "other" and back.checkpoints == ()
