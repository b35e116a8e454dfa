"""A strict double of ``cupy.cuda.nccl`` across processes, for the strict CuPy double.

``strict_cupy.installed(devices=N, nccl=True)`` puts it in place.  It keeps
NCCL's rules and refuses what NCCL refuses, so CI runs psflow's cross-host
NCCL path in real processes without a GPU:

* ``get_unique_id()`` starts a root (a thread of the calling process, as
  NCCL's bootstrap root is) on 127.0.0.1 and returns 128 ints naming it;
  ``NcclCommunicator(nranks, id, rank)`` joins it and blocks until all
  ``nranks`` ranks have joined.  The root refuses an id it did not make, a
  rank outside ``0..nranks-1`` or taken twice, a different ``nranks``, and
  two ranks on one GPU.
* collectives take raw device pointers, as NCCL does: a pointer must be the
  start of a live, C-contiguous device array of the double on the
  communicator's GPU, with room for ``count`` elements (host memory, another
  GPU's memory, a freed buffer are refused), and the stream must be one of
  that GPU.  The root checks that every rank called the same collective with
  the same count, type, operation and root (NCCL would hang or corrupt: the
  double fails the stream's work loudly instead) and computes the result in
  NumPy, in rank order.
* calls are asynchronous, as on a GPU: they return at once, the result is
  written later and the stream's work completes then (``Event.done``).  A
  peer that never calls (its process died) leaves the collective pending for
  good, as NCCL does, until ``comm.abort()`` ends it without a result.
* one thread driving two ranks of one communicator outside
  ``groupStart()``/``groupEnd()`` is refused (NCCL deadlocks there).

Collectives: ``allReduce``, ``broadcast``, ``bcast``, ``allGather``.
"""

from __future__ import annotations

import os
import secrets
import threading
import types
from multiprocessing.connection import Client, Listener
from typing import Any

import numpy as np

UNIQUE_ID_BYTES = 128
_MAGIC = b"sNCL"
INIT_SECONDS = 60.0  # NCCL would wait for missing ranks for good; tests stay bounded

SUCCESS, UNHANDLED_CUDA_ERROR, SYSTEM_ERROR, INTERNAL_ERROR = 0, 1, 2, 3
INVALID_ARGUMENT, INVALID_USAGE, REMOTE_ERROR = 4, 5, 6
_STATUS_NAMES = {
    1: "NCCL_ERROR_UNHANDLED_CUDA_ERROR",
    2: "NCCL_ERROR_SYSTEM_ERROR",
    3: "NCCL_ERROR_INTERNAL_ERROR",
    4: "NCCL_ERROR_INVALID_ARGUMENT",
    5: "NCCL_ERROR_INVALID_USAGE",
    6: "NCCL_ERROR_REMOTE_ERROR",
}

TYPES = {
    0: np.int8,
    1: np.uint8,
    2: np.int32,
    3: np.uint32,
    4: np.int64,
    5: np.uint64,
    6: np.float16,
    7: np.float32,
    8: np.float64,
}
CONSTANTS = {
    "NCCL_INT8": 0,
    "NCCL_CHAR": 0,
    "NCCL_UINT8": 1,
    "NCCL_INT32": 2,
    "NCCL_INT": 2,
    "NCCL_UINT32": 3,
    "NCCL_INT64": 4,
    "NCCL_UINT64": 5,
    "NCCL_FLOAT16": 6,
    "NCCL_HALF": 6,
    "NCCL_FLOAT32": 7,
    "NCCL_FLOAT": 7,
    "NCCL_FLOAT64": 8,
    "NCCL_DOUBLE": 8,
    "NCCL_SUM": 0,
    "NCCL_PROD": 1,
    "NCCL_MAX": 2,
    "NCCL_MIN": 3,
}
_REDUCE = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}


class NcclError(RuntimeError):
    """``cupy.cuda.nccl.NcclError``: a status and NCCL's text for it."""

    def __init__(self, status: int, detail: str = "") -> None:
        self.status = status
        name = _STATUS_NAMES.get(status, f"NCCL status {status}")
        super().__init__(f"{name}: {detail}" if detail else name)


class Work:
    """One collective queued on a stream: done once its result is written (or it was aborted)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.event = threading.Event()
        self.error: str | None = None  # the ranks broke NCCL's rules: the wait fails loudly

    def finished(self) -> bool:
        """Whether the stream has passed this work (raises when the ranks disagreed)."""
        done = self.event.is_set()
        if done and self.error is not None:
            raise RuntimeError(f"strict NCCL double: {self.what}: {self.error}")
        return done


# -- the root: one per unique id, in the process that called get_unique_id ------------------
class _Root:
    def __init__(self) -> None:
        self.nonce = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.nonce)
        host, port = self._listener.address
        raw = _MAGIC + bytes(map(int, host.split("."))) + port.to_bytes(2, "big") + self.nonce
        self.uid = tuple(int(b) for b in np.frombuffer(raw.ljust(UNIQUE_ID_BYTES, b"\0"), np.int8))
        self._lock = threading.Lock()
        self.nranks: int | None = None
        self.members: dict[int, Any] = {}  # rank -> connection
        self.devices: dict[tuple, int] = {}  # (pid, gpu) -> rank
        self.ready = threading.Event()
        self.ops: dict[int, dict[int, tuple]] = {}
        self._send_locks: dict[int, threading.Lock] = {}
        threading.Thread(target=self._serve, name="strict-nccl-root", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception:  # a joiner with another id fails authentication: keep serving
                continue
            threading.Thread(target=self._member, args=(conn,), daemon=True).start()

    def _send(self, rank: int, message: tuple) -> None:
        try:
            with self._send_locks[rank]:
                self.members[rank].send(message)
        except (OSError, EOFError):
            pass  # that rank is gone: the others notice nothing, as with NCCL

    def _member(self, conn: Any) -> None:
        try:
            _, uid, nranks, rank, device = conn.recv()
        except (OSError, EOFError):
            return
        refusal = self._join(conn, tuple(uid), nranks, rank, device)
        if refusal is not None:
            conn.send(("error", *refusal))
            conn.close()
            return
        if not self.ready.wait(INIT_SECONDS + 1):
            return  # the joiner times out itself
        self._send(rank, ("ready",))
        while True:
            try:
                _, seq, desc, payload = conn.recv()
            except (OSError, EOFError):
                return  # its process died: the collectives it owes never complete
            with self._lock:
                calls = self.ops.setdefault(seq, {})
                calls[rank] = (desc, payload)
                complete = len(calls) == self.nranks
                if complete:
                    del self.ops[seq]
            if complete:
                self._finish(seq, calls)

    def _join(self, conn: Any, uid: tuple, nranks: int, rank: int, device: tuple) -> tuple | None:
        with self._lock:
            if uid != self.uid:
                return INVALID_ARGUMENT, "the unique id is not the one this root made"
            if self.nranks is None:
                self.nranks = nranks
            if nranks != self.nranks:
                return INVALID_ARGUMENT, f"nranks {nranks} differs from the others' {self.nranks}"
            if not 0 <= rank < nranks:
                return INVALID_ARGUMENT, f"rank {rank} is not in [0, {nranks})"
            if rank in self.members:
                return INVALID_USAGE, f"rank {rank} joined twice"
            if device in self.devices:
                return (
                    INVALID_USAGE,
                    f"Duplicate GPU detected: rank {rank} and rank {self.devices[device]} "
                    f"both on CUDA device {device[1]} of process {device[0]}",
                )
            self.members[rank] = conn
            self.devices[device] = rank
            self._send_locks[rank] = threading.Lock()
            if len(self.members) == self.nranks:
                self.ready.set()
        return None

    def _finish(self, seq: int, calls: dict[int, tuple]) -> None:
        n = len(calls)
        descs = {rank: desc for rank, (desc, _) in calls.items()}
        if len(set(descs.values())) != 1:
            why = "the ranks called different collectives: " + ", ".join(
                f"rank {r}: {d}" for r, d in sorted(descs.items())
            )
            for rank in calls:
                self._send(rank, ("error", seq, why))
            return
        kind, _count, _dtype, extra = descs[0]
        payloads = [calls[r][1] for r in range(n)]
        if kind == "allReduce":
            total = payloads[0].copy()
            for p in payloads[1:]:
                _REDUCE[extra](total, p, out=total)
            results = [total] * n
        elif kind == "broadcast":
            results = [payloads[extra]] * n
        elif kind == "allGather":
            results = [np.concatenate(payloads)] * n
        else:  # pragma: no cover - every kind the communicator sends is above
            raise AssertionError(kind)
        for rank in range(n):
            self._send(rank, ("done", seq, results[rank]))


_roots: list[_Root] = []  # kept alive for the process's life, as NCCL's bootstrap root is


def get_unique_id() -> tuple[int, ...]:
    """A new unique id: 128 ints naming a root that listens in this process."""
    root = _Root()
    _roots.append(root)
    return root.uid


def _root_address(uid: Any) -> tuple[tuple[str, int], bytes]:
    if not isinstance(uid, tuple) or len(uid) != UNIQUE_ID_BYTES:
        raise NcclError(INVALID_ARGUMENT, f"commId must be a tuple of {UNIQUE_ID_BYTES} ints")
    raw = np.asarray(uid, np.int64)
    if raw.min() < -128 or raw.max() > 127:
        raise NcclError(INVALID_ARGUMENT, "commId values must be chars (-128..127)")
    data = raw.astype(np.int8).tobytes()
    if data[:4] != _MAGIC:
        raise NcclError(INVALID_ARGUMENT, "commId is not an id from get_unique_id()")
    host = ".".join(str(b) for b in data[4:8])
    port = int.from_bytes(data[8:10], "big")
    return (host, port), data[10:26]


# -- what a communicator needs of the CuPy double ----------------------------------------------
class _Thread(threading.local):
    def __init__(self) -> None:
        self.group_depth = 0
        self.grouped: list[tuple] = []
        self.outstanding: list[tuple[Any, Work]] = []  # (communicator, work) issued here


_thread = _Thread()


def groupStart() -> None:
    """Starts a group: the calls until :func:`groupEnd` are issued together."""
    _thread.group_depth += 1


def groupEnd() -> None:
    """Ends a group; at the outermost end its calls are issued, in order."""
    if _thread.group_depth == 0:
        raise NcclError(INVALID_USAGE, "groupEnd without groupStart")
    _thread.group_depth -= 1
    if _thread.group_depth == 0:
        grouped, _thread.grouped = _thread.grouped, []
        for comm, args in grouped:
            comm._dispatch(*args, grouped=True)


class NcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)``: one rank, on the current GPU.

    Blocks until every rank has joined (for at most ``INIT_SECONDS``: NCCL waits for good).
    """

    def __init__(self, ndev: int, commId: tuple, rank: int) -> None:
        from tests import strict_cupy

        if isinstance(ndev, bool) or not isinstance(ndev, int) or ndev < 1:
            raise NcclError(INVALID_ARGUMENT, f"ndev must be an int >= 1, got {ndev!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < ndev:
            raise NcclError(INVALID_ARGUMENT, f"rank {rank!r} is not in [0, {ndev})")
        address, nonce = _root_address(commId)
        self._cupy = strict_cupy
        self._device = strict_cupy._st().current()
        self._uid = commId
        self._rank, self._size = rank, ndev
        self._aborted = False
        self._async_error: NcclError | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._pending: dict[int, tuple[np.ndarray, Work]] = {}
        try:
            self._conn = Client(address, authkey=nonce)
        except Exception as e:  # the root is gone, or refused the id
            raise NcclError(SYSTEM_ERROR, f"cannot reach the id's root at {address}: {e}") from e
        self._conn.send(("init", commId, ndev, rank, (os.getpid(), self._device)))
        if not self._conn.poll(INIT_SECONDS):
            self._conn.close()
            raise NcclError(SYSTEM_ERROR, f"rank {rank}: not every rank joined in time")
        reply = self._conn.recv()
        if reply[0] == "error":
            self._conn.close()
            raise NcclError(reply[1], reply[2])
        self._send_lock = threading.Lock()
        self._receiver = threading.Thread(target=self._receive, daemon=True)
        self._receiver.start()

    @classmethod
    def initAll(cls, devices: Any) -> list[NcclCommunicator]:
        """Not modelled: psflow's cross-host path creates one rank per GPU by id."""
        raise NotImplementedError("the strict NCCL double does not model ncclCommInitAll")

    # -- queries -------------------------------------------------------------------------
    def rank_id(self) -> int:
        """This communicator's rank."""
        return self._rank

    def size(self) -> int:
        """How many ranks the communicator has."""
        return self._size

    def device_id(self) -> int:
        """The GPU this rank is on."""
        return self._device

    def check_async_error(self) -> None:
        """Raises the error that broke the communicator (a peer's process exited)."""
        if self._async_error is not None:
            raise self._async_error

    # -- collectives ---------------------------------------------------------------------
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream) -> None:
        """Reduces ``count`` elements of every rank into every rank's ``recvbuf``."""
        if op not in _REDUCE:
            raise NcclError(INVALID_ARGUMENT, f"unknown reduction {op!r}")
        self._call("allReduce", sendbuf, recvbuf, count, datatype, op, stream, count)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream) -> None:
        """Copies ``root``'s ``count`` elements into every rank's ``recvbuff``."""
        if not 0 <= root < self._size:
            raise NcclError(INVALID_ARGUMENT, f"root {root} is not in [0, {self._size})")
        send = sendbuff if self._rank == root else None
        self._call("broadcast", send, recvbuff, count, datatype, root, stream, count)

    def bcast(self, buff, count, datatype, root, stream) -> None:
        """In-place broadcast."""
        self.broadcast(buff, buff, count, datatype, root, stream)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream) -> None:
        """Every rank's ``count`` elements, in rank order, into every rank's ``recvbuf``."""
        self._call("allGather", sendbuf, recvbuf, count, datatype, 0, stream, count * self._size)

    def _call(self, kind, send, recv, count, datatype, extra, stream, out_count) -> None:
        if self._aborted:
            raise NcclError(INVALID_USAGE, "the communicator was aborted")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise NcclError(INVALID_ARGUMENT, f"count must be an int >= 0, got {count!r}")
        if datatype not in TYPES:
            raise NcclError(INVALID_ARGUMENT, f"unknown datatype {datatype!r}")
        dtype = np.dtype(TYPES[datatype])
        st = self._cupy._st()
        payload = None
        if send is not None:
            src = st.resolve(send, count * dtype.itemsize, self._device, f"{kind} sendbuf")
            payload = src.view(dtype).copy()  # NCCL reads it in stream order: nothing writes it
        dst = st.resolve(recv, out_count * dtype.itemsize, self._device, f"{kind} recvbuf")
        on = st.stream_of(stream, self._device)
        args = (kind, (kind, count, datatype, extra), payload, dst, on)
        if _thread.group_depth:
            _thread.grouped.append((self, args))
        else:
            self._dispatch(*args)

    def _dispatch(self, kind, desc, payload, dst, stream, grouped: bool = False) -> None:
        if not grouped:
            for other, work in _thread.outstanding:
                if other is not self and other._uid == self._uid and not work.event.is_set():
                    raise NcclError(
                        INVALID_USAGE,
                        f"this thread drives rank {other._rank} and rank {self._rank} of one "
                        "communicator outside groupStart()/groupEnd(): NCCL would deadlock",
                    )
        work = Work(f"{kind} on rank {self._rank}")
        _thread.outstanding = [(c, w) for c, w in _thread.outstanding if not w.event.is_set()]
        _thread.outstanding.append((self, work))
        st = self._cupy._st()
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._pending[seq] = (dst, work)
        st.writing(work, dst)
        stream.enqueue(work)
        if payload is None:
            payload = np.zeros(0, np.uint8)
        try:
            with self._send_lock:
                self._conn.send(("op", seq, desc, payload))
        except (OSError, EOFError):
            self._broken("the root's process is gone")

    def _broken(self, why: str) -> None:
        if self._async_error is None:
            self._async_error = NcclError(REMOTE_ERROR, why)

    def _receive(self) -> None:
        st = self._cupy._st()
        while True:
            try:
                message = self._conn.recv()
            except (OSError, EOFError):
                if not self._aborted:
                    self._broken("the connection to the root closed: a peer's process is gone")
                return  # what is pending stays pending, as NCCL's kernels spin on
            kind, seq = message[0], message[1]
            with self._lock:
                entry = self._pending.pop(seq, None)
            if entry is None:
                continue
            dst, work = entry
            if kind == "error":
                work.error = message[2]
            else:
                result = np.ascontiguousarray(message[2]).reshape(-1).view(np.uint8)
                dst[: result.size] = result
            st.written(work)
            work.event.set()

    # -- teardown ------------------------------------------------------------------------
    def abort(self) -> None:
        """Ends the pending collectives without results (their streams go on) and closes."""
        self._aborted = True
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        st = self._cupy._st()
        for _, work in pending:
            st.written(work)
            work.event.set()
        self._conn.close()

    def destroy(self) -> None:
        """Frees the communicator."""
        self._aborted = True
        self._conn.close()


def build_module() -> types.ModuleType:
    """The ``cupy.cuda.nccl`` module of the double."""
    mod = types.ModuleType("cupy.cuda.nccl")
    mod.available = True
    mod.NcclError = NcclError
    mod.NcclCommunicator = NcclCommunicator
    mod.get_unique_id = get_unique_id
    mod.get_version = lambda: 21805
    mod.groupStart = groupStart
    mod.groupEnd = groupEnd
    for name, value in CONSTANTS.items():
        setattr(mod, name, value)
    return mod


__all__ = ["NcclCommunicator", "NcclError", "Work", "build_module", "get_unique_id"]
