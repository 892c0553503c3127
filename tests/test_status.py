"""``gdskv status`` and ``gdskv check`` on real store directories."""

import json

import gdskv
from conftest import block
from gdskv.cli import main


def test_status_and_check_on_a_store(tmp_path, capsys):
    path = tmp_path / "s"
    with gdskv.open(path, dram="4MiB", ssd="64MiB") as store:
        for i in range(5):
            store.put(f"k{i}", block(i, 10_000))
    assert main(["status", str(path), "--json", str(tmp_path / "st.json")]) == 0
    out = capsys.readouterr().out
    assert "5 in 1 buckets" in out
    assert json.loads((tmp_path / "st.json").read_text())["nvme"]["objects"] == 5
    assert main(["check", str(path)]) == 0
    assert "0 corrupt" in capsys.readouterr().out


def test_check_finds_a_flipped_byte(tmp_path, capsys):
    path = tmp_path / "s"
    with gdskv.open(path, dram="4MiB", ssd="64MiB") as store:
        store.put("victim", block(1, 10_000))
    data = next((path / "buckets").glob("*.data"))
    raw = bytearray(data.read_bytes())
    raw[4096 + 100] ^= 0xFF  # inside the value (the record head is one 4 KiB block)
    data.write_bytes(raw)
    assert main(["check", str(path)]) == 1
    assert "1 corrupt" in capsys.readouterr().out
    with gdskv.open(path, dram="4MiB", ssd="64MiB") as store:
        assert store.get("victim") is None  # dropped, never served


def test_cli_reports_errors_cleanly(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["status", str(f)]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_status_opens_a_store_as_it_was_made_and_resizes_nothing(tmp_path, capsys, monkeypatch):
    """Without --backend and --ssd: the backend of the store's gdskv.json and, for an offset
    store (which cannot shrink, and would grow its data file to the default capacity), the
    capacity it was made with."""
    monkeypatch.delenv("GDSKV_BACKEND", raising=False)
    monkeypatch.delenv("GDSKV_SSD", raising=False)
    path = tmp_path / "s"
    with gdskv.open(path, dram="4MiB", ssd="64MiB", backend="offset", io_engine="psync") as store:
        store.put("k", block(1, 10_000))
    data = path / "offset" / "data"
    size = data.stat().st_size
    assert main(["status", str(path)]) == 0
    assert "1 in" in capsys.readouterr().out
    assert main(["check", str(path)]) == 0
    assert data.stat().st_size == size == 64 << 20
