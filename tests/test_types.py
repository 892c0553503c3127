"""Key encoding and the conversion of user buffers to byte views."""

import array

import numpy as np
import pytest

from gdskv.errors import InvalidKeyError, InvalidValueError
from gdskv.types import MAX_KEY_BYTES, byte_view, encode_key


def test_keys_encode_to_bytes():
    assert encode_key("ab") == b"ab"
    assert encode_key("é") == "é".encode()
    assert encode_key(b"\x00/..") == b"\x00/.."
    assert encode_key(bytearray(b"k")) == b"k"
    assert encode_key("x" * MAX_KEY_BYTES) == b"x" * MAX_KEY_BYTES


@pytest.mark.parametrize("bad", ["", b"", "x" * (MAX_KEY_BYTES + 1), 5, None, ("a",)])
def test_bad_keys(bad):
    with pytest.raises(InvalidKeyError):
        encode_key(bad)


def test_views_are_flat_bytes_without_copies():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = byte_view(arr)
    assert view.nbytes == 48 and view.format == "B" and view.ndim == 1
    arr[0, 0] = 99  # a view, not a copy
    assert np.frombuffer(view, dtype=np.float32)[0] == 99
    assert byte_view(array.array("d", [1.0, 2.0])).nbytes == 16
    assert byte_view(b"abc").readonly


def test_bad_values():
    with pytest.raises(InvalidValueError, match="contiguous"):
        byte_view(np.arange(10)[::2])
    with pytest.raises(InvalidValueError, match="empty"):
        byte_view(b"")
    with pytest.raises(InvalidValueError, match="buffer protocol"):
        byte_view([1, 2, 3])
    with pytest.raises(InvalidValueError, match="writable"):
        byte_view(b"abc", writable=True, what="out")


def test_torch_cpu_tensors_through_dlpack():
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float16)
    view = byte_view(t)
    assert view.nbytes == 12
    out = torch.zeros(6, dtype=torch.float16)
    wview = byte_view(out, writable=True)
    wview[:] = view
    assert torch.equal(out, t)
