"""``ckpt simulate --trace llama3``: the memory tier, replicas and JIT side by side (#31)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from ckpt_agent.cli.main import app
from ckpt_agent.cli.simulate import MemoryOptions, memory_report
from ckpt_agent.decide.sim_memory import TierCosts

ROWS = (
    "| fixed, storage only |",
    "| today's tiers |",
    "| memory tier + replicas |",
    "| memory tier + replicas + JIT |",
)


def run(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["simulate", "--trace", "llama3", "--days", "3", *args])
    return r.exit_code, r.output


def test_llama3_prints_the_four_plans_side_by_side() -> None:
    code, out = run()
    assert code == 0, out
    for row in ROWS:
        assert row in out
    assert "goodput" in out and "lost/failure steps mean" in out and "recovery s mean" in out
    assert "scaled to 16,384 GPUs, 3 days, seed 0" in out
    assert "simulated, not measured" in out
    assert "MTBF" not in out.split("**")[0]  # the policy suite did not run
    assert "traces in" not in out


def test_options_reach_the_model() -> None:
    code, out = run(
        "--no-jit",
        "--replicas",
        "2",
        "--memory-tier-every",
        "7",
        "--gpus",
        "2048",
        "--fixed-every",
        "50",
        "--state-gib",
        "4",
    )
    assert code == 0, out
    assert "+ JIT" not in out
    assert "scaled to 2,048 GPUs" in out
    assert "replicated to 2 peer(s)" in out and "state 4 GiB per node" in out
    assert "| fixed, storage only | 50 | — |" in out
    assert "| memory tier + replicas | " in out and " | 7 | " in out
    code, out = run("--replicas", "0")
    assert code == 0 and "memory tier, no replica" in out


def test_the_same_seed_prints_the_same_table() -> None:
    assert run("--seed", "4")[1] == run("--seed", "4")[1]
    assert run("--seed", "4")[1] != run("--seed", "5")[1]


def test_bad_values_are_refused_with_the_option_named() -> None:
    for args in (("--peer-loss", "2"), ("--replicas", "-1"), ("--memory-tier-every", "0")):
        code, out = run(*args)
        assert code == 2, out
        assert args[0] in out


def test_help_teaches_the_memory_options() -> None:
    r = CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    for opt in (
        "--memory-tier-every",
        "--replicas",
        "--jit",
        "--no-jit",
        "--peer-loss",
        "--same-rack",
        "--storage-read-gbps",
        "llama3",
    ):
        assert opt in r.output


def test_a_file_named_llama3_is_read_as_a_file_when_given_as_a_path(tmp_path: Path) -> None:
    f = tmp_path / "llama3"
    f.write_text("[100.0, 5000.0]")
    r = CliRunner().invoke(app, ["simulate", "--trace", str(f), "--only-file", "--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert "**llama3**" in r.output and "memory tier" not in r.output


def test_memory_report_without_the_cli() -> None:
    lines: list[str] = []
    memory_report(MemoryOptions(days=2, jit=False), TierCosts(), lines.append)
    assert lines[0].startswith("step 2 s;")
    assert sum(line.startswith(ROWS[:3]) for line in lines) == 6  # both tables
