"""Socket primitives of the TCP data plane: gather-send and exact receive into a buffer.

``send_buffers`` hands many buffers to ``sendmsg`` at once (up to ``IOV_MAX`` per call) and
resumes after partial sends; ``recv_exact`` fills a caller's buffer with ``recv_into``. Both
move bytes between the socket and the caller's memory directly, with no intermediate copy.
A peer that closes before a frame is complete raises :class:`PeerDisconnectedError`.

Sockets stay in blocking mode; deadlines are kernel socket timeouts (``SO_RCVTIMEO`` /
``SO_SNDTIMEO``, see :func:`set_deadline`), so a transfer costs one system call per chunk
and not a ``poll`` before each one as Python's ``settimeout`` would.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from typing import List, Optional, Sequence

from gdskv.errors import PeerDisconnectedError, TransportError

IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


def send_buffers(sock: socket.socket, buffers: Sequence["bytes | memoryview"], *, peer: str = "") -> int:
    """Send every byte of ``buffers`` in order; return the total sent."""
    pending: List[memoryview] = [memoryview(b).cast("B") if not isinstance(b, bytes) else memoryview(b) for b in buffers]
    pending = [b for b in pending if b.nbytes]
    total = 0
    start = 0
    try:
        while start < len(pending):
            window = pending[start : start + IOV_MAX]
            sent = sock.sendmsg(window)
            total += sent
            while sent:
                head = pending[start]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    start += 1
                else:
                    pending[start] = head[sent:]
                    sent = 0
    except OSError as exc:
        if _timed_out(exc):
            raise TransportError("peer stopped reading (send timed out)", peer=peer, sent=total) from None
        raise TransportError(f"send failed: {exc.strerror or exc}", peer=peer, sent=total, errno=exc.errno) from None
    return total


def recv_exact(sock: socket.socket, view: memoryview, *, peer: str = "", what: str = "frame") -> None:
    """Fill ``view`` entirely from ``sock``."""
    got = 0
    size = view.nbytes
    try:
        while got < size:
            n = sock.recv_into(view[got:], size - got)
            if n == 0:
                raise PeerDisconnectedError(
                    f"peer closed the connection in the middle of a {what}", peer=peer, expected=size, got=got
                )
            got += n
    except PeerDisconnectedError:
        raise
    except OSError as exc:
        if _timed_out(exc):
            raise TransportError(f"peer timed out in the middle of a {what}", peer=peer, expected=size, got=got) from None
        raise PeerDisconnectedError(
            f"connection broke in the middle of a {what}: {exc.strerror or exc}", peer=peer, expected=size, got=got
        ) from None


def recv_bytes(sock: socket.socket, size: int, *, peer: str = "", what: str = "frame") -> bytearray:
    buf = bytearray(size)
    recv_exact(sock, memoryview(buf), peer=peer, what=what)
    return buf


def recv_header_or_eof(sock: socket.socket, size: int, *, peer: str = "") -> "bytearray | None":
    """Receive a ``size``-byte header, or None if the peer closed cleanly before its first byte."""
    buf = bytearray(size)
    view = memoryview(buf)
    try:
        first = sock.recv_into(view, size)
    except OSError:
        return None
    if first == 0:
        return None
    if first < size:
        recv_exact(sock, view[first:], peer=peer, what="header")
    return buf


def _timed_out(exc: OSError) -> bool:
    return isinstance(exc, socket.timeout) or exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def set_deadline(sock: socket.socket, seconds: Optional[float]) -> None:
    """Fail a send or receive that makes no progress for ``seconds`` (None: wait forever)."""
    whole = int(seconds) if seconds else 0
    micro = int(((seconds or 0.0) - whole) * 1e6)
    timeval = struct.pack("ll", whole, micro)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def tune(sock: socket.socket) -> None:
    """Blocking mode, no Nagle delay; the kernel sizes the socket buffers itself."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
