"""Trace readers: formats, chaining, ordering, and clear errors for malformed input."""

from __future__ import annotations

import gzip
import json

import pytest

from gdskv.errors import ConfigError, IoError
from gdskv.trace import TraceFormatError, ideal_hits, read_trace


def write_lines(path, lines):
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))
    return path


def mooncake(ts_ms, ids, inp=None, out=10):
    return {"timestamp": ts_ms, "input_length": inp if inp is not None else 512 * len(ids), "output_length": out, "hash_ids": ids}


def qwen(chat, ts_s, ids, parent=-1, turn=1, kind="text"):
    return {
        "chat_id": chat, "parent_chat_id": parent, "timestamp": ts_s, "input_length": 16 * len(ids),
        "output_length": 5, "type": kind, "turn": turn, "hash_ids": ids,
    }


def test_mooncake_is_detected_and_converted(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake(0, [0, 1, 2]), "", mooncake(2500, [0, 1, 3], inp=1400)])
    trace = read_trace(path)
    assert (trace.format, trace.block_tokens, trace.skipped) == ("mooncake", 512, 0)
    assert [r.timestamp for r in trace.requests] == [0.0, 2.5]  # ms -> s
    assert [r.blocks for r in trace.requests] == [[0, 1, 2], [0, 1, 3]]
    assert trace.requests[1].input_length == 1400 and trace.requests[1].output_length == 10
    assert trace.accesses == 6 and trace.unique_blocks() == 4


def test_requests_are_replayed_in_timestamp_order_ties_in_file_order(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake(3000, [7]), mooncake(1000, [5]), mooncake(1000, [6])])
    assert [r.blocks for r in read_trace(path).requests] == [[5], [6], [7]]


def test_qwen_hash_ids_are_chained(tmp_path):
    # Per-block hashes, not chained. Request 3 starts like request 2 (hash 9) and then has
    # the hashes of request 1's blocks 2 and 3 — but after a different prefix, so its KV
    # differs: only its first block is cached. Request 4 continues request 1.
    hashes = [[1, 2, 3], [9, 8], [9, 2, 3], [1, 2, 3, 4]]
    path = write_lines(
        tmp_path / "q.jsonl",
        [qwen(1, 0.0, hashes[0]), qwen(2, 1.0, hashes[1]), qwen(3, 2.0, hashes[2], parent=2, turn=2),
         qwen(4, 3.0, hashes[3], parent=1, turn=2)],
    )
    trace = read_trace(path)
    assert (trace.format, trace.block_tokens) == ("qwen", 16)
    r1, r2, r3, r4 = (r.blocks for r in trace.requests)
    assert r3[0] == r2[0] and not set(r3[1:]) & set(r1)
    assert r4[:3] == r1 and len(set(r4)) == 4
    # Hand count, chained: request 3 hits 1 block (9), request 4 hits 3 (1, 2, 3) -> 4.
    assert ideal_hits(trace.block_lists()) == 4
    # Taken unchained, request 3 would wrongly hit all 3 of its blocks -> 6.
    assert ideal_hits(hashes) == 6


def test_qwen_repeated_hash_within_a_request_is_two_blocks(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [qwen(1, 0.0, [5, 5, 5])])
    blocks = read_trace(path).requests[0].blocks
    assert len(set(blocks)) == 3


def test_generic_with_header(tmp_path):
    header = {"format": "gdskv-trace", "version": 1, "block_tokens": 64, "chained": False, "time_unit": "ms"}
    path = write_lines(
        tmp_path / "g.jsonl",
        [header, {"timestamp": 0, "blocks": ["sys", "a"]}, {"timestamp": 1500, "blocks": ["sys", "b"], "output_length": 3}],
    )
    trace = read_trace(path)
    assert (trace.format, trace.block_tokens) == ("generic", 64)
    (a, b) = (r.blocks for r in trace.requests)
    assert a[0] == b[0] and a[1] != b[1]
    assert trace.requests[1].timestamp == 1.5 and trace.requests[1].output_length == 3
    assert trace.requests[0].input_length == 128  # default: blocks x block_tokens


def test_generic_without_header_is_chained_seconds(tmp_path):
    path = write_lines(tmp_path / "g.jsonl", [{"timestamp": 0.5, "blocks": [10, 11]}, {"timestamp": 2, "blocks": [10, 12]}])
    trace = read_trace(path)
    assert (trace.format, trace.block_tokens) == ("generic", 16)
    assert trace.requests[1].timestamp == 2.0
    assert ideal_hits(trace.block_lists()) == 1


def test_gzip(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(mooncake(0, [1, 2])) + "\n")
    assert read_trace(path).accesses == 2


BAD_LINES = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"timestamp": 1, "input_length": 5, "output_length": 1}), "missing field 'hash_ids'"),
    (json.dumps(mooncake(1, [1, "x"])), "'hash_ids'[1] must be an integer"),
    (json.dumps(mooncake(1, [1, True])), "'hash_ids'[1] must be an integer"),
    (json.dumps(mooncake("soon", [1])), "'timestamp' must be a finite number"),
    (json.dumps(mooncake(-5, [1])), "must not be negative"),
    (json.dumps({**mooncake(1, [1]), "input_length": 1.5}), "'input_length' must be a non-negative integer"),
    (json.dumps({**mooncake(1, [1]), "hash_ids": 7}), "must be a list"),
]


@pytest.mark.parametrize("bad,why", BAD_LINES)
def test_malformed_line_names_its_line(tmp_path, bad, why):
    path = write_lines(tmp_path / "t.jsonl", [mooncake(0, [1]), "", bad, mooncake(9, [2])])
    with pytest.raises(TraceFormatError) as info:
        read_trace(path)
    assert info.value.context["line"] == 3 and info.value.context["path"] == str(path)
    assert why in str(info.value) and "line=3" in str(info.value)


def test_skip_bad_counts_and_keeps_the_rest(tmp_path):
    lines = [mooncake(0, [1])] + [bad for bad, _ in BAD_LINES] + [mooncake(9, [1, 2])]
    trace = read_trace(write_lines(tmp_path / "t.jsonl", lines), skip_bad=True)
    assert trace.skipped == len(BAD_LINES)
    assert [n for n, _ in trace.skipped_lines] == list(range(2, 2 + len(BAD_LINES)))
    assert [r.blocks for r in trace.requests] == [[1], [1, 2]]


def test_qwen_specific_fields_are_checked(tmp_path):
    path = write_lines(tmp_path / "q.jsonl", [qwen(1, 0.0, [1]), {**qwen(2, 1.0, [2]), "chat_id": "two"}])
    with pytest.raises(TraceFormatError, match="'chat_id' must be an integer") as info:
        read_trace(path)
    assert info.value.context["line"] == 2


def test_generic_header_errors(tmp_path):
    late = write_lines(tmp_path / "a.jsonl", [{"timestamp": 0, "blocks": [1]}, {"format": "gdskv-trace"}])
    with pytest.raises(TraceFormatError, match="header must be the first line"):
        read_trace(late)
    bad = write_lines(tmp_path / "b.jsonl", [{"format": "gdskv-trace", "version": 9}, {"timestamp": 0, "blocks": [1]}])
    with pytest.raises(TraceFormatError, match="unsupported generic trace version"):
        read_trace(bad)
    unit = write_lines(tmp_path / "c.jsonl", [{"format": "gdskv-trace", "time_unit": "h"}, {"timestamp": 0, "blocks": [1]}])
    with pytest.raises(TraceFormatError, match="'time_unit'"):
        read_trace(unit)


def test_unknown_shape_asks_for_format(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [{"time": 0, "ids": [1]}])
    with pytest.raises(TraceFormatError, match="pass --format") as info:
        read_trace(path)
    assert info.value.context["line"] == 1


def test_explicit_format_and_unknown_format(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [qwen(1, 3.0, [1, 2])])
    with pytest.raises(TraceFormatError, match="missing field 'blocks'"):
        read_trace(path, format="generic")
    with pytest.raises(ConfigError, match="unknown trace format") as info:
        read_trace(path, format="csv")
    assert "mooncake" in info.value.context["valid"]


def test_empty_or_all_bad_trace(tmp_path):
    with pytest.raises(TraceFormatError, match="no valid request"):
        read_trace(write_lines(tmp_path / "e.jsonl", ["", "  "]))
    with pytest.raises(TraceFormatError, match="no valid request") as info:
        read_trace(write_lines(tmp_path / "b.jsonl", ["{", "nope"]), skip_bad=True)
    assert info.value.context["skipped"] == 2


def test_missing_file_is_an_io_error(tmp_path):
    with pytest.raises(IoError, match="cannot open trace") as info:
        read_trace(tmp_path / "absent.jsonl")
    assert info.value.context["path"].endswith("absent.jsonl")


def test_not_utf8(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(mooncake(0, [1])).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        read_trace(path)


def test_limit(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [mooncake(i, [i]) for i in range(10)])
    assert len(read_trace(path, limit=4).requests) == 4
