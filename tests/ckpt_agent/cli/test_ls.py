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
