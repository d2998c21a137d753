"""``ckpt ls`` on a run full of garbage (issue #28): past RICH_ROWS_MAX checkpoints a plain
aligned table and the first reasons with a count of the rest; small runs keep the rich
table with every reason; --json lists everything."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from ckpt_agent.cli.ls import REASONS_SHOWN, RICH_ROWS_MAX, plain_table
from ckpt_agent.cli.main import app
from ckpt_agent.policy.models import RetentionSpec, Tier
from ckpt_agent.records import CheckpointRecord, CheckpointStatus, checkpoint_id

RUN = "garbage-run"


def _garbage(root: Path, n: int) -> None:
    for step in range(n):
        folder = root / RUN / "steps" / checkpoint_id(Tier.PULSE, step)
        os.makedirs(folder)
        (folder / "COMMIT").write_bytes(b"\x00 garbage")


def _ls(root: Path, *extra: str) -> tuple[int, str]:
    res = CliRunner().invoke(
        app, ["ls", "--storage", str(root), "--run-id", RUN, *extra], env={"COLUMNS": "200"}
    )
    return res.exit_code, res.output


def test_a_large_listing_is_plain_text_with_the_first_reasons(tmp_path: Path) -> None:
    n = RICH_ROWS_MAX + 5
    _garbage(tmp_path, n)
    code, out = _ls(tmp_path)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[1].split() == ["checkpoint", "step", "tier", "status", "class", "score",
                                "size", "committed", "flags"]  # fmt: skip
    rows = [line for line in lines if line.startswith("pulse_step_") and "corrupted" in line]
    assert len(rows) == n and "│" not in out and "┃" not in out  # no rich box
    reasons = [line for line in lines if line.startswith("pulse_step_") and ": " in line]
    assert len(reasons) == REASONS_SHOWN
    assert lines[-1].startswith(f"... and {n - REASONS_SHOWN} more corrupted checkpoint(s)")
    assert "ckpt ls --json" in lines[-1]
    code, out = _ls(tmp_path, "--json")
    assert code == 0 and len(json.loads(out)) == n  # everything, every reason
    assert all(r["reason"] for r in json.loads(out))


def test_a_small_listing_keeps_the_rich_table_and_every_reason(tmp_path: Path) -> None:
    _garbage(tmp_path, 3)
    code, out = _ls(tmp_path)
    assert code == 0 and ("┃" in out or "│" in out)
    assert sum(1 for line in out.splitlines() if "not valid JSON" in line) == 3


def test_plain_rows_are_aligned_and_cleaned() -> None:
    rec = CheckpointRecord(
        id=checkpoint_id(Tier.PULSE, 7),
        step=7,
        tier=Tier.PULSE,
        status=CheckpointStatus.VALID,
        size_bytes=2048,
        extra={},
    )
    lines = plain_table([rec], RetentionSpec())
    header, row = lines
    end = header.index("step") + len("step")
    assert row[end - 1 : end + 1] == "7 "  # numbers right-aligned under their header
    assert "2.0 KiB" in row and "valid" in row and "\x1b" not in row


def test_ls_names_the_writer_that_holds_the_run_in_one_clean_line(tmp_path: Path) -> None:
    """#28: the holder's generation, pod, node and since when; stored names cleaned."""
    from ckpt_agent.format.fence import claim, writer_key
    from ckpt_agent.storage.fs import LocalStorage

    _garbage(tmp_path, 1)
    code, out = _ls(tmp_path)
    assert code == 0 and "writer: none has claimed this run" in out
    store = LocalStorage(tmp_path)
    claim(store, RUN, environ={"CKPT_POD_NAME": "old-0", "CKPT_NODE_NAME": "lost-node"})
    claim(store, RUN, environ={"CKPT_POD_NAME": "job-r1-0", "CKPT_NODE_NAME": "gpu-2"})
    code, out = _ls(tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("writer:")]
    assert code == 0 and len(lines) == 1, out
    assert lines[0].startswith("writer: generation 2 holds the run: pod job-r1-0 on node gpu-2")
    assert ", since 20" in lines[0]
    # a planted record with escapes in its names: shown escaped, never raw
    raw = (
        b'{"generation": 3, "pod": "x\\u001b]0;owned\\u0007y", "node": "n\\nwriter: fake",'
        b' "time": 1764990000.0, "version": 1}'
    )
    (tmp_path / writer_key(RUN, 3)).write_bytes(raw)
    code, out = _ls(tmp_path)
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert len([line for line in out.splitlines() if line.startswith("writer:")]) == 1
    assert "generation 3" in out
    (tmp_path / writer_key(RUN, 4)).write_bytes(b"not json")
    code, out = _ls(tmp_path)
    assert code == 0 and "generation 4 holds the run (its record is unreadable" in out


def test_a_large_listing_names_the_holder_too(tmp_path: Path) -> None:
    from ckpt_agent.format.fence import claim
    from ckpt_agent.storage.fs import LocalStorage

    _garbage(tmp_path, RICH_ROWS_MAX + 1)
    claim(LocalStorage(tmp_path), RUN, environ={"CKPT_POD_NAME": "p", "CKPT_NODE_NAME": "n"})
    code, out = _ls(tmp_path)
    lines = [line for line in out.splitlines() if line.startswith("writer:")]
    assert code == 0 and len(lines) == 1
    assert lines[0].startswith("writer: generation 1 holds the run: pod p on node n, since ")
