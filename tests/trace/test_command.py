"""``gdskv trace replay|sweep|reuse`` end to end, through gdskv.cli.main."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gdskv.cli import main
from gdskv.tiers.backends.record import record_size

# The hand-checked requests of test_simulator.py, as a Mooncake trace. With 512-token blocks
# and 8 KV bytes per token a block is 4096 bytes: DRAM 2 blocks, SSD 5 records, one-block
# buckets gives 3 DRAM hits and 5 SSD hits of 13 (worked out in test_eager_ssd_by_hand).
REQUESTS = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5], [1, 2, 4]]
BLOCK = 4096
TIERS = ["--kv-bytes-per-token", "8", "--dram", str(2 * BLOCK), "--ssd", str(5 * record_size(32, BLOCK)),
         "--bucket-bytes", str(BLOCK)]


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(r), "output_length": 1, "hash_ids": r}) + "\n"
        for i, r in enumerate(REQUESTS)
    ))
    return path


def test_replay_table_and_json(trace_file, tmp_path, capsys):
    out_json = tmp_path / "r.json"
    assert main(["trace", "replay", str(trace_file), *TIERS, "--json", str(out_json)]) == 0
    table = capsys.readouterr().out
    assert "5 requests" in table and "13 block accesses" in table and "prefill speedup" in table
    data = json.loads(out_json.read_text())
    assert (data["requests"], data["accesses"], data["unique_blocks"]) == (5, 13, 5)
    assert data["dram_hit_rate"] == pytest.approx(3 / 13) and data["nvme_hit_rate"] == pytest.approx(5 / 13)
    assert data["ideal_hit_rate"] == pytest.approx(8 / 13)
    assert (data["dram_read_bytes"], data["nvme_read_bytes"]) == (3 * BLOCK, 5 * BLOCK)
    assert data["config"]["dram_blocks"] == 2 and data["trace"]["format"] == "mooncake"


def test_replay_json_to_stdout_only(trace_file, capsys):
    assert main(["trace", "replay", str(trace_file), *TIERS, "--ssd", "0", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["nvme_hit_rate"] == 0 and data["config"]["ssd_bytes"] == 0


def test_sweep_table_json_and_plot(trace_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png, out_json = tmp_path / "s.png", tmp_path / "s.json"
    args = ["trace", "sweep", str(trace_file), "--kv-bytes-per-token", "8", "--bucket-bytes", str(BLOCK),
            "--dram", f"{BLOCK}..{4 * BLOCK}", "--ssd", f"0,{5 * record_size(32, BLOCK)}",
            "--plot", str(png), "--json", str(out_json), "--target", "0.5"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "6 replays" in table and "hit rate >= 50.0%" in table
    data = json.loads(out_json.read_text())
    assert [p["dram_bytes"] for p in data["points"]][:3] == [BLOCK, 2 * BLOCK, 4 * BLOCK]
    point = next(p for p in data["points"] if p["dram_bytes"] == 2 * BLOCK and p["ssd_bytes"] > 0)
    assert point["hit_rate"] == pytest.approx(8 / 13)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reuse_table_json_and_plot(trace_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    assert main(["trace", "reuse", str(trace_file), "--plot", str(png), "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["reuses"] == 8 and data["within_10min"] == 1.0  # 8 reuses, 1 to 4 s apart
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_malformed_line_is_reported_with_its_number(trace_file, capsys):
    with open(trace_file, "a") as f:
        f.write('{"timestamp": 9000, "input_length": 5, "output_length": 1, "hash_ids": ["x"]}\n')
    assert main(["trace", "reuse", str(trace_file)]) == 2
    err = capsys.readouterr().err
    assert "line=6" in err and "'hash_ids'[0] must be an integer" in err
    assert main(["trace", "reuse", str(trace_file), "--skip-bad"]) == 0
    assert "skipped 1 malformed lines (line 6:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--policy", "mru"], "valid='lru, fifo'"),
        (["--offload", "lazy"], "unknown offload policy"),
        (["--promotion", "often"], "--promotion takes a read count"),
        (["--dram", "1KiB"], "larger than the DRAM tier"),
    ],
)
def test_bad_options_are_clear_errors(trace_file, capsys, extra, needle):
    assert main(["trace", "replay", str(trace_file), *TIERS, *extra]) == 2
    assert needle in capsys.readouterr().err


def test_importing_gdskv_and_the_cli_does_not_import_matplotlib():
    code = (
        "import sys, gdskv, gdskv.cli, gdskv.trace, gdskv.trace.command; gdskv.cli.build_parser(); "
        "print('matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
