"""``gdskv demo``: the main job, run small through the CLI entry point."""

from __future__ import annotations

import numpy as np
import pytest

from gdskv.cli import main
from gdskv.demo import Blocks


@pytest.mark.parametrize("offload", ["watermark", "eager"])
def test_demo_writes_reads_back_and_verifies(tmp_path, capsys, offload):
    rc = main(["demo", "--size", "6MiB", "--block", "128KiB", "--dram", "1MiB", "--dir", str(tmp_path),
               "--offload", offload, "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS: " in out and "FAIL" not in out
    for heading in ("Where reads were served from", "Tiers", "Data movement", "offloaded to NVMe", "promoted"):
        assert heading in out
    assert list(tmp_path.iterdir()) == []  # its working directory is removed


def test_demo_bad_sizes_are_config_errors(tmp_path, capsys):
    rc = main(["demo", "--size", "4MiB", "--block", "2MiB", "--dram", "1MiB", "--dir", str(tmp_path)])
    assert rc == 2
    assert "--block must fit in the DRAM tier" in capsys.readouterr().err
    assert main(["demo", "--size", "lots", "--dir", str(tmp_path)]) == 2
    assert main(["demo", "--size", "4MiB", "--offload", "sometimes", "--dir", str(tmp_path)]) == 2
    assert "eager, watermark" in capsys.readouterr().err


def test_demo_blocks_are_distinct_and_verification_catches_one_wrong_byte():
    blocks = Blocks(count=64, size=4096, seed=1)
    values = {blocks.value(i).tobytes() for i in range(64)}
    assert len(values) == 64
    out = blocks.value(5).copy()
    assert blocks.verify(5, out, out.nbytes)
    assert not blocks.verify(6, out, out.nbytes)  # another block's bytes
    assert not blocks.verify(5, out, None)  # a miss
    out[4095] ^= 1
    assert not blocks.verify(5, out, out.nbytes)
    assert np.array_equal(Blocks(64, 4096, seed=1).value(9), blocks.value(9))  # deterministic
