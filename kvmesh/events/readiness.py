"""Waiting for ZMQ sockets on an asyncio event loop, without pyzmq's asyncio poller.

A router hears each engine step's KV-event batch, and each peer replica's decision, on its own:
hundreds of wake-ups a second, each carrying one small message. pyzmq's poller sets up and tears
down futures and reader callbacks on every poll, which cost a subscriber more CPU than decoding
the batch (docs/BENCHMARKS.md, "KV-event wire"). Here the loop itself watches each socket's ZMQ
descriptor (``add_reader``), and one coroutine waits for any of them to signal, then reads without
blocking for as long as the socket says a whole message is there.

ZMQ's descriptor signals an edge (messages may have come, or the socket's state changed), not a
level, and asking the socket (:func:`readable`) or reading from it consumes the signal. So the
waiting coroutine clears the wake-up *before* it asks the sockets, and reads each one until it is
empty (or a bound is reached, and it asks again after a turn of the loop): a message that comes
after the question sets the wake-up again, and none is left unnoticed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar, cast

import zmq

_M = TypeVar("_M")


class SocketWatch:
    """Wakes a coroutine waiting in :meth:`wait` when a watched socket's descriptor signals, or
    on :meth:`wake`. Used from one event loop's thread; a socket is unwatched before it is closed."""

    __slots__ = ("_event", "_watched")

    def __init__(self) -> None:
        self._event = asyncio.Event()
        # socket -> the loop watching its descriptor, and the descriptor
        self._watched: dict[zmq.Socket[bytes], tuple[asyncio.AbstractEventLoop, int]] = {}

    def watch(self, sock: zmq.Socket[bytes]) -> None:
        """Watch ``sock`` on the running loop."""
        loop = asyncio.get_running_loop()
        fd = cast(int, sock.getsockopt(zmq.FD))
        loop.add_reader(fd, self._event.set)
        self._watched[sock] = (loop, fd)
        self._event.set()  # (a message may be there already, its signal consumed: ask the socket)

    def unwatch(self, sock: zmq.Socket[bytes]) -> None:
        """Stop watching ``sock`` (before closing it: its descriptor goes with it)."""
        watched = self._watched.pop(sock, None)
        if watched is not None and not watched[0].is_closed():
            watched[0].remove_reader(watched[1])

    def close(self) -> None:
        """Stop watching every socket."""
        for sock in list(self._watched):
            self.unwatch(sock)

    def wake(self) -> None:
        """Wake the waiting coroutine (or the next :meth:`wait`) at once."""
        self._event.set()

    def clear(self) -> None:
        """Forget the wake-ups so far: call it before asking the sockets."""
        self._event.clear()

    async def wait(self, timeout: float | None = None) -> None:
        """Until a watched socket signals or :meth:`wake` (returns at once if one did since
        :meth:`clear`), or ``timeout`` seconds pass."""
        if timeout is None:
            await self._event.wait()
            return
        try:
            await asyncio.wait_for(self._event.wait(), max(timeout, 0.0))
        except asyncio.TimeoutError:
            pass


def readable(sock: zmq.Socket[bytes]) -> bool:
    """A whole message is waiting on ``sock`` (asking consumes its descriptor's signal)."""
    return bool(cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


def drain(
    sock: zmq.Socket[bytes],
    read: Callable[[zmq.Socket[bytes]], _M],
    handle: Callable[[_M], object],
    limit: int,
) -> bool:
    """Read and handle what is queued on ``sock`` without waiting, up to ``limit`` messages;
    True when it stopped at the limit with more there (ask again after a turn of the loop). Each
    read follows the socket's word that a message is there, which is cheaper than the exception
    a read of an empty socket raises."""
    for _ in range(limit):
        if not readable(sock):
            return False
        handle(read(sock))
    return True


def recv_frames(sock: zmq.Socket[bytes]) -> list[bytes]:
    """One whole message's frames, without blocking (after :func:`readable`)."""
    return sock.recv_multipart(zmq.NOBLOCK)
