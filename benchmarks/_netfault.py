"""A TCP relay that injects network faults: latency, a stall, a reset; and then heals.

Where the kernel has no ``tc netem`` (and tests do not run as root), the faults
a real network makes can still be put between two psflow processes: point the
client at a :class:`ChaosRelay` instead of the server.  The relay listens on
``127.0.0.1:0`` and forwards every connection to its target, both directions,
chunk by chunk, through a queue per direction, so it can

* **delay** each chunk by a fixed one-way latency (10 ms each way: a 20 ms
  round trip), without limiting throughput: chunks keep arriving while earlier
  ones wait, and leave in order;
* **stall**: hold every byte (connections stay open, nothing arrives; reads
  stop once a direction holds :data:`MAX_HELD_CHUNKS`, so the sender's TCP
  window closes as it would across a partition that keeps TCP up);
* **cut**: reset every connection (RST, not FIN) and reset new ones at once,
  as a rebooted middlebox or a dropped NAT entry does;
* **heal**: let bytes flow again (what a stall held is delivered, in order).

Modes change at once from any thread; counters (:meth:`ChaosRelay.stats`)
show what went through, so a test can prove its traffic really took the relay
(psflow's shared-memory path would bypass it: turn it off with
``PSFLOW_SHM=0`` in every process).

Example::

    with ChaosRelay("127.0.0.1:50051", delay_ms=10) as relay:
        client = PSClient(relay.address)   # every call now takes >= 20 ms
        relay.stall(); ...; relay.heal()
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import socket
import struct
import threading
import time
from typing import Any

__all__ = ["ChaosRelay", "MAX_HELD_CHUNKS", "Mode"]

#: chunks one direction of one connection holds before it stops reading
MAX_HELD_CHUNKS = 1024
_CHUNK = 1 << 16
_CONTROL_TIMEOUT = 10.0


class Mode(enum.Enum):
    """What the relay does with the bytes it receives."""

    FLOW = "flow"  #: forward (after the configured delay)
    STALL = "stall"  #: hold everything, connections stay up
    CUT = "cut"  #: reset every connection, old and new


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes the connection with a RST: linger on, zero seconds."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Link:
    """One relayed connection: client <-> relay <-> target."""

    def __init__(self, relay: ChaosRelay, client: tuple, upstream: tuple) -> None:
        self.relay = relay
        self.client_reader, self.client_writer = client
        self.up_reader, self.up_writer = upstream
        self.tasks: list[asyncio.Task] = []
        self.open_directions = 2

    def start(self) -> None:
        for reader, writer, key in (
            (self.client_reader, self.up_writer, "bytes_up"),
            (self.up_reader, self.client_writer, "bytes_down"),
        ):
            queue: asyncio.Queue = asyncio.Queue(MAX_HELD_CHUNKS)
            self.tasks.append(asyncio.ensure_future(self._read(reader, queue)))
            self.tasks.append(asyncio.ensure_future(self._write(queue, writer, key)))

    async def _read(self, reader: asyncio.StreamReader, queue: asyncio.Queue) -> None:
        try:
            while True:
                data = await reader.read(_CHUNK)
                # stamped on arrival: the delay is the same whatever waits before it
                await queue.put((time.monotonic() + self.relay.delay_s, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            self.close(reset=True)

    async def _write(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, key: str) -> None:
        try:
            while True:
                due, data = await queue.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await self.relay._flowing.wait()  # a stall holds the bytes here
                if not data:  # the sender closed its side: pass the FIN on
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    self.open_directions -= 1
                    if not self.open_directions:
                        self.close(reset=False)
                    return
                self.relay._count(key, len(data))  # before the peer can see them
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            self.close(reset=True)

    def close(self, reset: bool) -> None:
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for writer in (self.client_writer, self.up_writer):
            if reset:
                _reset(writer)
            else:
                writer.close()
        self.relay._links.discard(self)


class ChaosRelay:
    """Forwards TCP connections from :attr:`address` to ``target``, with faults on demand.

    Args:
        target: ``host:port`` every accepted connection is forwarded to.
        delay_ms: one-way delay added to every chunk, each direction.
        bind: where to listen (a loopback address; port 0: any free one).

    Raises:
        ValueError: ``target`` is not ``host:port`` or ``delay_ms`` is negative.
    """

    def __init__(self, target: str, *, delay_ms: float = 0.0, bind: str = "127.0.0.1") -> None:
        self._target = _split(target)
        self.target = target
        self.set_delay(delay_ms)
        self._bind = bind
        self._links: set[_Link] = set()
        self._stats = {"connections": 0, "resets": 0, "bytes_up": 0, "bytes_down": 0}
        self._stats_lock = threading.Lock()
        self.mode = Mode.FLOW
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-relay")
        self._thread.daemon = True
        self._server: asyncio.AbstractServer | None = None
        self.port = 0

    # --- lifecycle ------------------------------------------------------------------
    def __enter__(self) -> ChaosRelay:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> ChaosRelay:
        """Starts listening (in a thread of its own); :attr:`address` is valid afterwards."""
        self._thread.start()
        self._flowing = self._call(self._make_event)
        self._server = self._call(self._listen)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        """Resets every connection, stops listening and ends the thread; safe to call twice."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(RuntimeError, TimeoutError):
            self._call(self._shutdown)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CONTROL_TIMEOUT)
        if not self._thread.is_alive():
            self._loop.close()

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self._bind}:{self.port}"

    # --- faults ---------------------------------------------------------------------
    def set_delay(self, delay_ms: float) -> None:
        """Sets the one-way delay of chunks that arrive from now on."""
        if not delay_ms >= 0:
            raise ValueError(f"delay_ms must be >= 0, got {delay_ms!r}")
        self.delay_s = delay_ms / 1000.0

    def stall(self) -> None:
        """Holds every byte from now on; connections stay open."""
        self._call(self._set_mode, Mode.STALL)

    def cut(self) -> None:
        """Resets every connection and every new one until :meth:`heal`."""
        self._call(self._set_mode, Mode.CUT)

    def heal(self) -> None:
        """Forwards again (what a stall held goes first)."""
        self._call(self._set_mode, Mode.FLOW)

    def stats(self) -> dict[str, int]:
        """Connections accepted, connections reset, bytes forwarded each way."""
        with self._stats_lock:
            return dict(self._stats)

    # --- inside the loop --------------------------------------------------------------
    def _call(self, fn: Any, *args: Any) -> Any:
        async def run() -> Any:
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(_CONTROL_TIMEOUT)

    @staticmethod
    def _make_event() -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    async def _listen(self) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._accept, self._bind, 0)

    def _count(self, key: str, n: int) -> None:
        with self._stats_lock:
            self._stats[key] += n

    def _set_mode(self, mode: Mode) -> None:
        self.mode = mode
        if mode is Mode.FLOW:
            self._flowing.set()
            return
        self._flowing.clear()
        if mode is Mode.CUT:
            for link in list(self._links):
                link.close(reset=True)
                self._count("resets", 1)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._count("connections", 1)
        if self.mode is Mode.CUT:
            self._count("resets", 1)
            _reset(writer)
            return
        try:
            upstream = await asyncio.wait_for(
                asyncio.open_connection(*self._target), _CONTROL_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError):
            _reset(writer)  # the target is gone: the client sees a reset, as it would
            return
        link = _Link(self, (reader, writer), upstream)
        self._links.add(link)
        link.start()
        if self.mode is Mode.CUT:  # cut while the upstream connection was being made
            link.close(reset=True)

    async def _shutdown(self) -> None:
        for link in list(self._links):
            link.close(reset=True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        # let every pump see its cancellation before the loop stops (no pending tasks left)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    """Runs one relay until stdin closes (a process of its own, e.g. inside a namespace).

    Prints ``RELAY host:port`` once it listens.
    """
    import argparse
    import sys

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="host:port to forward to")
    p.add_argument("--bind", default="127.0.0.1", help="address to listen on (port: any)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    args = p.parse_args(argv)
    with ChaosRelay(args.target, delay_ms=args.delay_ms, bind=args.bind) as relay:
        print(f"RELAY {relay.address}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin (or kills us)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
