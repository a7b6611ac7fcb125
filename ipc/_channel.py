"""The control channel: framed records and file descriptors over one ``socketpair``.

Runs in both processes. The trainer creates the pair with ``multiprocessing.Pipe()`` (an
``AF_UNIX`` stream socketpair), keeps one end and hands the other to exactly one spawned worker,
so the peer is always our own process. Records are those of :mod:`ipc.wire`, each in one frame
(:data:`wire.FRAME`: payload length and kind): the two records of every batch, ``BatchReady`` and
``Release``, in fixed binary layouts, everything else pickled. A file descriptor (an arena's memfd)
travels as ``SCM_RIGHTS`` on the frame of the record that announces it.

Receiving is bulk: one ``recvmsg_into`` takes every byte (and descriptor) waiting, and
:meth:`ControlChannel.receive_ready` returns every complete record in it. The kernel never reads
past a message carrying descriptors, so a descriptor is in hand once its record is.

The peer's end of stream (it closed or died, also in the middle of a frame) sets
:attr:`ControlChannel.at_eof`; waiting for a record after it raises :class:`ChannelClosed`. A frame
that breaks the contract raises :class:`wire.ProtocolError`.
"""

from __future__ import annotations

import array
import os
import pickle
import select
import socket
import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from . import wire

#: Bytes read per ``recvmsg_into`` at most (the buffer grows for a larger frame).
_CHUNK = 1 << 16
#: Descriptors one receive can carry (the kernel stops a read at the first message carrying any).
_MAX_FDS = 4
_FD_SPACE = socket.CMSG_SPACE(_MAX_FDS * array.array("i").itemsize)


class ChannelClosed(EOFError):
    """The peer closed its end of the control channel (or died)."""


class ControlChannel:
    """One end of a worker's control channel. One thread receives; sending is locked, so a
    worker's log relay may send from another thread."""

    __slots__ = (
        "_buffer",
        "_closed",
        "_codec",
        "_end",
        "_eof",
        "_fds",
        "_poller",
        "_send_lock",
        "_sock",
        "_start",
    )

    def __init__(self, end: Connection | socket.socket) -> None:
        """``end``: one end of ``multiprocessing.Pipe()`` (duplex) or of ``socket.socketpair()``;
        the channel takes it over."""
        if isinstance(end, socket.socket):
            self._sock = end
        else:
            self._sock = socket.socket(fileno=os.dup(end.fileno()))
            end.close()
        self._buffer = bytearray(_CHUNK)
        self._start = 0  # first unparsed byte
        self._end = 0  # one past the last received byte
        self._eof = False
        self._closed = False
        self._fds: deque[int] = deque()
        self._codec = wire.BatchCodec()
        self._poller: select.poll | None = None
        self._send_lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def at_eof(self) -> bool:
        """The peer's end of stream was read (records received before it are still returned)."""
        return self._eof

    def fileno(self) -> int:
        return self._sock.fileno()

    # ------------------------------------------------------------------------------ sending
    def send(self, message: Any, *, fd: int | None = None) -> None:
        """Send one record (and ``fd``, which the receiver gets its own duplicate of)."""
        frame = self._codec.encode(message)
        try:
            with self._send_lock:
                if fd is None:
                    self._sock.sendall(frame)
                else:
                    rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))
                    sent = self._sock.sendmsg([frame], [rights])
                    if sent < len(frame):
                        self._sock.sendall(memoryview(frame)[sent:])
        except (BrokenPipeError, ConnectionResetError) as error:
            raise ChannelClosed("the peer closed the control channel") from error
        except OSError:
            if self._closed:
                raise ChannelClosed("this end of the control channel is closed") from None
            raise

    # ------------------------------------------------------------------------------ receiving
    def receive_ready(self) -> list[Any]:
        """Every complete record already sent, without waiting (maybe none): one receive at
        most. After the peer's end of stream it returns the records sent before it, then
        nothing, and :attr:`at_eof` is set."""
        if self._start != self._end:
            records = self._parse()
            if records:
                return records
        if self._eof:
            return []
        self._fill(block=False)
        return self._parse()

    def recv(self) -> Any:
        """The next record, waiting for it."""
        while True:
            record = self._parse_one()
            if record is not _NOTHING:
                return record
            if self._eof:
                raise ChannelClosed("the peer closed the control channel")
            self._fill(block=True)

    def ready(self) -> bool:
        """True when a record (or the end of stream) can be read now, without waiting."""
        if self._closed:
            return False
        if self._eof or self._has_frame():
            return True
        poller = self._poller
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._sock.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def recv_fd(self) -> int:
        """The descriptor sent with the last record that carried one. The caller owns it."""
        if not self._fds:
            raise wire.ProtocolError("a record that announces a descriptor came without one")
        return self._fds.popleft()

    def close(self) -> None:
        """Close this end and any descriptor received but not taken. Idempotent."""
        if self._closed:
            return
        self._closed = True
        while self._fds:
            os.close(self._fds.popleft())
        self._sock.close()

    # ------------------------------------------------------------------------------ internals
    def _fill(self, *, block: bool) -> None:
        """Receive what is waiting (``block``: wait for at least one byte)."""
        if self._closed:
            raise ChannelClosed("this end of the control channel is closed")
        buffer = self._buffer
        if self._start == self._end:
            self._start = self._end = 0
        elif len(buffer) - self._end < _CHUNK // 4:
            # move the unparsed tail to the front; grow when a frame needs more room
            tail = buffer[self._start : self._end]
            needed = self._frame_size()
            size = max(_CHUNK, len(tail) + _CHUNK // 2, needed or 0)
            if size > len(buffer):
                buffer = self._buffer = bytearray(size)
            buffer[: len(tail)] = tail
            self._start, self._end = 0, len(tail)
        view = memoryview(buffer)[self._end :]
        flags = 0 if block else socket.MSG_DONTWAIT
        try:
            count, ancillary, msg_flags, _address = self._sock.recvmsg_into(
                [view], _FD_SPACE, flags
            )
        except (BlockingIOError, InterruptedError):
            return
        except ConnectionResetError:
            self._eof = True
            return
        finally:
            view.release()
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self._fds.extend(fds)
        if msg_flags & socket.MSG_CTRUNC:
            raise wire.ProtocolError("the peer sent more descriptors than one record may carry")
        if count == 0:
            self._eof = True
        self._end += count

    def _frame_size(self) -> int | None:
        """Bytes of the frame at the parse position, once its header is in."""
        if self._end - self._start < wire.FRAME.size:
            return None
        length: int = wire.FRAME.unpack_from(self._buffer, self._start)[0]
        return wire.FRAME.size + length

    def _has_frame(self) -> bool:
        size = self._frame_size()
        return size is not None and self._end - self._start >= size

    def _parse_one(self) -> Any:
        start = self._start
        if self._end - start < _HEAD:
            return _NOTHING
        length, kind = _unpack_frame(self._buffer, start)
        end = start + _HEAD + length
        if end > self._end:
            return _NOTHING
        self._start = end
        return self._decode(kind, start + _HEAD, end)

    def _parse(self) -> list[Any]:
        records: list[Any] = []
        while (record := self._parse_one()) is not _NOTHING:
            records.append(record)
        return records

    def _decode(self, kind: int, start: int, end: int) -> Any:
        if kind == wire.FRAME_PICKLED:
            try:
                return pickle.loads(self._buffer[start:end])
            except Exception as error:
                raise wire.ProtocolError(f"a record could not be unpickled: {error!r}") from None
        return self._codec.decode(kind, self._buffer, start, end)


_NOTHING: Any = object()
_HEAD = wire.FRAME.size
_unpack_frame = wire.FRAME.unpack_from
