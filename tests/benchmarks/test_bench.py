"""A smoke pass of `odt bench --quick`: it runs end to end and writes well-formed output (no timing asserts)."""

from __future__ import annotations

import json

from benchmarks.cli import main


def test_bench_quick_writes_well_formed_results(tmp_path, capsys):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["quick"] and result["matmul_gflops"] > 0
    assert [r["model"] for r in result["rows"]] == ["MLP 784-256-128-10", "digits sample"]
    for row in result["rows"]:
        for key in ("ort_step_ms", "torch_step_ms", "speedup", "ort_gflops", "rss_ort_mib", "rss_torch_mib",
                    "import_ort_s", "load_first_step_ort_s", "generation_s", "artifact_bytes"):  # fmt: skip
            assert row[key] > 0, key
        assert len(row["ort_losses"]) == len(row["torch_losses"]) == 15 and row["blocks"] == 3
        low, high = row["speedup_interval"]
        assert low <= row["speedup"] <= high  # the bootstrap interval brackets the median ratio
    table = (tmp_path / "bench.md").read_text()
    assert table.count("\n| ") == 2 + len(result["rows"]) - 1 and "| digits sample | 32 |" in table
    assert (tmp_path / "bench_steps.png").stat().st_size > 5_000
    assert (tmp_path / "bench_losses.png").stat().st_size > 5_000
    assert "speedup" in capsys.readouterr().out


def test_bench_runs_chosen_rows_into_their_own_file(tmp_path, capsys):
    assert main(["--quick", "--only", "digits", "--name", "bench_digits", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "bench_digits.json").read_text())
    assert [r["model"] for r in result["rows"]] == ["digits sample"]
    assert not (tmp_path / "bench.json").exists() and not (tmp_path / "bench_steps.png").exists()
