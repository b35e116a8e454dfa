"""The PS message format: each message's encoder beside its decoder.

A push is a ``PushHeader`` (one item per gradient: name, spec, sparse or
dense, codec, base version; the request context: exactly-once id, sync step,
waiting, staleness bound, update rule) followed by the payload, every item's
bytes back to back in item order (a sparse item: its ``<i8`` row indices,
then its rows; a compressed one: its codec's wire bytes).  The payload
travels in the same message (unary), in chunks (a stream), as a data-plane
frame, or in a same-host shared-memory segment the header names.

A pull reply is a ``PullHeader`` (name, spec, version per tensor) followed
by every tensor's bytes back to back.

A write (create, assign, add, subtract) is a ``WriteHeader`` (the op, one
spec per variable, an exactly-once id) followed by the values' bytes, the
same way.

The client (:class:`~psflow.transport.PSClient`) encodes with
:func:`encode_push` and decodes with :class:`PullDecoder`; the server
(``ps_server.servicer``) decodes with :func:`decode_push` (the request
context too, :func:`push_context`) and encodes with :func:`pull_header`.  The variables'
list and the counters are encoded and decoded here too.  A change of the
format touches this file (and the ``.proto``) only.  The request context is
one :class:`~psflow.ps.push_types.PushContext` from the session to the store.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from psflow import compression
from psflow.errors import InvalidArgumentError
from psflow.observability.logs import set_log_context
from psflow.proto import ps_pb2
from psflow.ps import write_ops
from psflow.ps.names import quote
from psflow.ps.push_types import Gradient, PushContext, PushReply
from psflow.ps.tensors import Segments, segments_from_pieces
from psflow.wire import codec

from . import framing

__all__ = [
    "DecodedPush",
    "PullDecoder",
    "VariableDescription",
    "as_gradients",
    "decode_push",
    "decode_write",
    "encode_push",
    "encode_write",
    "payload_pieces",
    "pull_header",
    "pull_items",
    "pull_request",
    "push_reply",
    "push_reply_bytes",
    "push_codecs",
    "push_context",
    "stats_from_reply",
    "stats_reply",
    "variable_descriptions",
    "variables_reply",
]


# -- push ---------------------------------------------------------------------------------
def as_gradients(
    grads: Mapping[str, Any] | Sequence[Gradient],
    base_versions: Mapping[str, int] | Sequence[int] | None,
) -> list[Gradient]:
    """A push's gradients in their one shape; the mapping short form
    (``{name: dense}`` / ``{name: (indices, rows)}``) converted here.

    Raises:
        InvalidArgumentError: base versions given twice (items carry their own)
            or a list of them whose length differs from the gradients'.
    """
    if not isinstance(grads, Mapping):
        if base_versions is not None:
            raise InvalidArgumentError(
                "base_versions given with Gradient items, which carry their own base version"
            )
        return list(grads)
    names = list(grads)
    if isinstance(base_versions, Mapping):
        bases = [int(base_versions.get(n, -1)) for n in names]
    elif base_versions is not None:
        bases = [int(b) for b in base_versions]
        if len(bases) != len(names):
            raise InvalidArgumentError(f"{len(bases)} base versions for {len(names)} grads")
    else:
        bases = [-1] * len(names)
    out = []
    for name, base in zip(names, bases):
        g = grads[name]
        if isinstance(g, tuple):
            out.append(Gradient(name, g[1], g[0], base))
        else:
            out.append(Gradient(name, g, None, base))
    return out


def push_codecs(
    names: Sequence[str], spec: str | Mapping[str, str] | None
) -> dict[str, compression.Codec | None]:
    """Each gradient's codec (a name for all, or per name), every name checked
    before anything is sent.

    Raises:
        InvalidArgumentError: an unknown codec name.
    """
    if spec is None:
        return dict.fromkeys(names)
    if isinstance(spec, str):
        return dict.fromkeys(names, compression.get_codec(spec))
    return {n: compression.get_codec(spec.get(n, "none")) for n in names}


def encode_push(
    items: Sequence[Gradient],
    context: PushContext,
    codecs: str | Mapping[str, str] | None = None,
    shm_buffer: Any = None,
) -> tuple[bytes, list[np.ndarray]]:
    """A push's header bytes and its payload's arrays, in order.

    ``codecs``: see :func:`push_codecs`; ``shm_buffer``: a
    :class:`psflow.transport.shm.PayloadBuffer` the payload is written into
    (the header names it, no array is returned).

    Raises:
        InvalidArgumentError: an unknown codec, or one for a sparse gradient.
    """
    chosen_codecs = None if codecs is None else push_codecs([g.name for g in items], codecs)
    header = ps_pb2.PushHeader(wait_applied=context.wait_applied, rule_json=context.rule_json)
    header.id.client_id, header.id.sequence = context.push_id
    if context.step is not None:
        header.step = int(context.step)
        header.num_required = int(context.num_required or 0)
    if context.max_staleness is not None:
        header.max_staleness = int(context.max_staleness)
    arrays: list[np.ndarray] = []
    for item in items:
        name, base, g = item.name, item.base_version, item.values
        chosen = None if chosen_codecs is None else chosen_codecs[name]
        if chosen is not None and not isinstance(g, compression.Encoded):
            if item.indices is not None:
                raise InvalidArgumentError(f"compression of sparse gradient {name!r}")
            g = chosen.encode(codec.to_host(g))
        if isinstance(g, compression.Encoded):
            header.items.add(
                name=name,
                values=codec.spec_to_proto(g.dtype, g.shape),
                base_version=base,
                compression=g.codec.wire_code,
            )
            arrays.append(np.ascontiguousarray(g.wire))
        elif item.indices is not None:
            idx = codec.to_host(item.indices).astype("<i8", copy=False).reshape(-1)
            vals = codec.to_host(g)
            header.items.add(
                name=name,
                values=codec.spec_to_proto(vals.dtype, vals.shape),
                sparse=True,
                base_version=base,
            )
            arrays += [idx, vals]
        else:
            arr = codec.to_host(g)
            header.items.add(
                name=name, values=codec.spec_to_proto(arr.dtype, arr.shape), base_version=base
            )
            arrays.append(arr)
    if shm_buffer is not None:
        header.shm_payload = shm_buffer.write(arrays)
        arrays = []
    return header.SerializeToString(), arrays


def push_context(header: ps_pb2.PushHeader, timeout: float | None) -> PushContext:
    """The request context a push header carries (``timeout``: the call's time left).

    Raises:
        InvalidArgumentError: no exactly-once id.
    """
    if not header.HasField("id") or not header.id.client_id:
        raise InvalidArgumentError("a push needs a request id (client_id, sequence)")
    return PushContext(
        (header.id.client_id, header.id.sequence),
        step=header.step if header.HasField("step") else None,
        num_required=header.num_required,
        wait_applied=header.wait_applied,
        timeout=timeout,
        rule_json=header.rule_json,
        max_staleness=header.max_staleness if header.HasField("max_staleness") else None,
    )


@dataclasses.dataclass(frozen=True)
class DecodedPush:
    """A push as received: ``args``, what the store's ``push`` takes (the gradients,
    the one request context, the client's ``peer_gone``); each gradient's payload
    bytes and when decoding began (for metrics)."""

    args: tuple[list[Gradient], PushContext, Callable[[], bool]]
    item_bytes: list[tuple[str, int]]
    start: float


class _GradientWhat:
    """``gradient for 'name'``, formatted only when an error message needs it."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"gradient for {quote(self.name)}"


def payload_pieces(sizes: Sequence[int], payloads: Iterable[memoryview]) -> list[list[memoryview]]:
    """Each item's bytes as views of a streamed payload's chunks, as they arrived.

    Raises:
        InvalidArgumentError: more or fewer bytes than ``sizes`` add up to.
    """
    assembler = framing.PayloadAssembler(sizes)
    for payload in payloads:
        assembler.feed(payload)
    assembler.finish()
    return [assembler.pieces(k) for k in range(len(sizes))]


def decode_push(
    request: Any,
    payloads: Iterable[memoryview] | None = None,
    *,
    spec: Callable[[Any, str], tuple[np.dtype, tuple, int]],
    shm_view: Callable[[str, int], memoryview],
    chunk_bytes: int,
) -> DecodedPush:
    """A push's gradients and request context from its header and payload, the
    request named in the log context as soon as its id is read.

    Args:
        request: a :class:`~psflow.transport.dataplane.Request`: its header, its
            time left; its ``payload``, without ``payloads``, is the whole payload in
            a buffer the caller reuses once the push is applied (the data plane's;
            the store copies what it keeps past the call: a pending sync contribution).
        payloads: the payload's chunks as received (a gRPC stream's).
        spec: ``spec(tensor_spec, name)`` checks an item's spec against the
            receiver's limits: ``(dtype, shape, nbytes)``.
        shm_view: ``shm_view(segment, nbytes)``, the payload in a shared-memory
            segment the header names.
        chunk_bytes: a payload in one buffer is applied in pieces this large
            (the optimizer then updates cache-sized blocks).

    Raises:
        InvalidArgumentError: a malformed item, no request id, or a payload of the
            wrong size.
    """
    start = time.perf_counter()
    header = framing.parse_header(request.header, ps_pb2.PushHeader)
    context = push_context(header, request.time_remaining())
    client, sequence = context.push_id
    set_log_context(step=context.step, request_id=f"{client[:64]}:{sequence}")
    borrowed = request.payload if payloads is None else None
    layout, sizes = [], []
    for item in header.items:
        dtype, shape, nbytes = spec(item.values, item.name)
        if item.sparse:
            if not shape:
                raise InvalidArgumentError(f"sparse gradient for {quote(item.name)} has no rows")
            sizes.append(shape[0] * 8)
        wire = dtype
        if item.compression:
            wire = compression.wire_dtype(
                item.compression, dtype, f"gradient for {quote(item.name)}"
            )
        layout.append((item, dtype, shape, wire, len(sizes)))
        sizes.append(nbytes // dtype.itemsize * wire.itemsize)
    view = borrowed
    if header.shm_payload:
        if borrowed is not None and len(borrowed):
            raise InvalidArgumentError(
                f"a push with {len(borrowed)} payload bytes names a shared-memory payload too"
            )
        view = shm_view(header.shm_payload, sum(sizes))
    if view is None:
        pieces = payload_pieces(sizes, payloads or ())
    else:  # one buffer, cut per item in chunks (a 64 MB SGD step: 17 ms whole, 13 ms in 1 MB)
        total, pieces, pos = sum(sizes), [], 0
        if len(view) != total:
            raise InvalidArgumentError(
                f"payload of {len(view)} bytes where its header announced {total}"
            )
        for n in sizes:
            if 0 < n <= chunk_bytes:  # most items of a step: one piece, no range to walk
                pieces.append([view[pos : pos + n]])
            else:
                end = pos + n
                pieces.append(
                    [view[i : min(i + chunk_bytes, end)] for i in range(pos, end, chunk_bytes)]
                )
            pos += n
    grads, item_bytes = [], []
    for item, dtype, shape, wire, k in layout:
        # the sizes were checked against the header above: only a bool payload can
        # still be refused here, so its message is built only then
        what = _GradientWhat(item.name)
        if view is not None and wire.kind != "b" and chunk_bytes % wire.itemsize == 0:
            # whole elements per piece, sized by the header: viewed as they are
            step = chunk_bytes // wire.itemsize
            parts = [(j * step, np.frombuffer(p, wire)) for j, p in enumerate(pieces[k])]
            values = Segments(wire, shape, parts or [(0, np.empty(0, wire))])
        else:  # chunks as they came, or bool bytes to check: joined where misaligned
            values = segments_from_pieces(wire, shape, pieces[k], what=what)
        if item.compression:
            values = compression.decode_segments(item.compression, values, dtype)
        indices = None
        if item.sparse:
            indices = codec.tensor_from_buffer(
                np.dtype("<i8"),
                (shape[0],),
                framing.join_pieces(pieces[k - 1]),
                what=f"indices of {what}",
            )
            values = values.to_array()
        grads.append(Gradient(item.name, values, indices, item.base_version))
        item_bytes.append((item.name, sizes[k] + (sizes[k - 1] if item.sparse else 0)))
    return DecodedPush((grads, context, request.peer_gone), item_bytes, start)


def push_reply_bytes(reply: PushReply) -> bytes:
    """A push's ``PushResponse``, serialized."""
    # filled field by field: the constructor's keyword path costs ~4 us more per reply
    # (upb converts each repeated keyword on its own), the same bytes
    message = ps_pb2.PushResponse(applied=reply.applied, duplicate=reply.duplicate)
    message.versions.extend(reply.versions)
    message.staleness.extend(reply.staleness)
    return message.SerializeToString()


def push_reply(reply: ps_pb2.PushResponse) -> PushReply:
    """A ``PushResponse``'s :class:`PushReply`."""
    return PushReply(tuple(reply.versions), reply.applied, reply.duplicate, tuple(reply.staleness))


# -- write ----------------------------------------------------------------------------------
def encode_write(
    op: int,
    values: Mapping[str, Any],
    request_id: tuple[str, int] | None = None,
    trainable: bool | Mapping[str, bool] = False,
    optimizer_json: str = "",
) -> tuple[ps_pb2.WriteHeader, list[np.ndarray]]:
    """A write's header (``op``: a ``WRITE_OP_*``) and the host arrays of ``{name: value}``."""
    arrays = [codec.to_host(v) for v in values.values()]
    header = ps_pb2.WriteHeader(
        op=op,
        variables=[
            ps_pb2.VariableSpec(
                name=name,
                spec=codec.spec_to_proto(a.dtype, a.shape),
                trainable=trainable if isinstance(trainable, bool) else trainable.get(name, True),
                optimizer_json=optimizer_json,
            )
            for name, a in zip(values, arrays, strict=True)
        ],
    )
    if request_id is not None:
        header.id.client_id, header.id.sequence = request_id
    return header, arrays


def decode_write(
    header_bytes: bytes,
    payloads: Iterable[memoryview],
    spec: Callable[[int, Any, str], tuple[np.dtype, tuple, int]],
) -> tuple[ps_pb2.WriteHeader, list[tuple[Any, np.dtype, tuple]], list[Segments]]:
    """A write's header, each variable's ``(spec message, dtype, shape)`` (checked
    by ``spec(dtype_code, shape, what)``) and its value, views of ``payloads``.

    Raises:
        InvalidArgumentError: an unknown op, a bad spec, or a payload of the wrong size.
    """
    header = framing.parse_header(header_bytes, ps_pb2.WriteHeader)
    if header.op != ps_pb2.WRITE_OP_CREATE and not write_ops.is_wire_write(header.op):
        raise InvalidArgumentError(f"unknown write op {header.op}")
    specs = [
        (v, *spec(v.spec.dtype, v.spec.shape, f"variable {quote(v.name)}"))
        for v in header.variables
    ]
    pieces = payload_pieces([s[3] for s in specs], payloads)
    values = [
        segments_from_pieces(dtype, shape, part, what=f"value of {quote(v.name)}")
        for part, (v, dtype, shape, _) in zip(pieces, specs, strict=True)
    ]
    return header, [s[:3] for s in specs], values


# -- pull ---------------------------------------------------------------------------------
def pull_header(tensors: Sequence[Any]) -> bytes:
    """A pull reply's header for ``tensors`` (each with ``name``, ``value``, ``version``)."""
    return ps_pb2.PullHeader(
        tensors=[
            ps_pb2.PulledTensor(
                name=t.name,
                spec=codec.spec_to_proto(t.value.dtype, t.value.shape),
                version=t.version,
            )
            for t in tensors
        ]
    ).SerializeToString()


def pull_request(
    names: Sequence[str], chunk_bytes: int, indices: np.ndarray | None = None
) -> ps_pb2.PullRequest:
    """A pull of ``names``, or of rows ``indices`` (``<i8``) of the one name."""
    if indices is None:
        items = [ps_pb2.PullItem(name=n) for n in names]
    else:
        items = [ps_pb2.PullItem(name=names[0], indices=codec.encode_tensor(indices))]
    return ps_pb2.PullRequest(items=items, chunk_bytes=chunk_bytes)


def pull_items(
    request: ps_pb2.PullRequest, spec: Callable[[int, Any, str], Any]
) -> tuple[list[str], dict[int, np.ndarray]]:
    """A pull's names and, by item, its row indices (checked by ``spec(dtype, shape, what)``)."""
    rows = {}
    for i, item in enumerate(request.items):
        if item.HasField("indices"):
            idx = item.indices
            spec(idx.dtype, idx.shape, f"row indices for {quote(item.name)}")
            rows[i] = codec.decode_tensor(idx, max_bytes=1 << 62)
    return [item.name for item in request.items], rows


class _Filler:
    """Copies a pull's streamed payload into the output arrays, in order."""

    def __init__(self, views: list[np.ndarray]) -> None:
        self._views = views
        self._index = 0
        self._offset = 0
        self._skip()

    def _skip(self) -> None:
        while self._index < len(self._views) and self._offset == self._views[self._index].size:
            self._index += 1
            self._offset = 0

    def feed(self, data: memoryview | None) -> None:
        if data is None:
            return
        one = len(self._views) == 1 and self._index == 0 and self._offset == 0
        if one and len(data) == self._views[0].size:
            # the usual unary reply: one tensor, all of it in one message
            self._views[0][:] = np.frombuffer(data, np.uint8)
            self._offset = len(data)
            self._skip()
            return
        pos = 0
        while pos < len(data):
            if self._index >= len(self._views):
                raise InvalidArgumentError("pull reply holds more bytes than its header announced")
            view = self._views[self._index]
            take = min(len(data) - pos, view.size - self._offset)
            view[self._offset : self._offset + take] = np.frombuffer(
                data[pos : pos + take], np.uint8
            )
            pos += take
            self._offset += take
            self._skip()

    def finish(self) -> None:
        if self._index < len(self._views):
            raise InvalidArgumentError(
                "pull reply truncated: fewer bytes than its header announced"
            )


class PullDecoder:
    """Decodes one pull reply into arrays (``out``'s, checked, or new ones).

    ``seen(name, dtype, shape)`` is told every dense tensor's spec (a client
    sizes its later pulls by them); ``rows``: a row pull (no spec to tell).
    """

    def __init__(
        self,
        out: Sequence[np.ndarray | None] | None,
        rows: bool,
        seen: Callable[[str, np.dtype, tuple[int, ...]], None],
    ) -> None:
        self._out, self._rows, self._seen = out, rows, seen
        self.header: ps_pb2.PullHeader | None = None
        self.arrays: list[np.ndarray] | None = None

    def _specs(self, header: ps_pb2.PullHeader) -> list[tuple[np.dtype, tuple[int, ...]]]:
        specs = []
        for t in header.tensors:
            dtype, shape = codec.dtype_from_wire(t.spec.dtype), tuple(t.spec.shape)
            specs.append((dtype, shape))
            if not self._rows:
                self._seen(t.name, dtype, shape)
        return specs

    def _targets(self, header: ps_pb2.PullHeader) -> list[np.ndarray]:
        arrays = []
        out = self._out
        for k, (dtype, shape) in enumerate(self._specs(header)):
            target = out[k] if out is not None else None
            if target is None:
                target = np.empty(shape, dtype)
            elif target.dtype != dtype or target.shape != shape or not target.flags.c_contiguous:
                name = header.tensors[k].name
                raise InvalidArgumentError(
                    f"out[{k}] is {target.dtype}{list(target.shape)}, the pulled {name!r} is "
                    f"{dtype.name}{list(shape)} (C-contiguous needed)"
                )
            arrays.append(target)
        return arrays

    def messages(self, messages: Iterable[bytes]) -> list[tuple[np.ndarray, int]]:
        """``[(array, version), ...]`` of a reply in gRPC messages (unary or streamed).

        Raises:
            InvalidArgumentError: no header, a second one, or a payload of the wrong size.
        """
        it = iter(messages)
        header_bytes, payload = framing.split_message(next(it))
        if header_bytes is None:
            raise InvalidArgumentError("pull reply without a header")
        self.header = ps_pb2.PullHeader.FromString(header_bytes)
        self.arrays = self._targets(self.header)
        filler = _Filler([framing.byte_view(a) for a in self.arrays])
        filler.feed(payload)
        for message in it:
            hdr, payload = framing.split_message(message)
            if hdr is not None:
                raise InvalidArgumentError("pull reply with a second header")
            filler.feed(payload)
        filler.finish()
        return list(zip(self.arrays, [t.version for t in self.header.tensors]))

    def sink(self, header_bytes: bytes, n: int) -> memoryview | None:
        """A data-plane sink for a pull into ``out``: one tensor's payload lands
        straight in its array.  (Without ``out`` none is needed: the reply lands
        in a new buffer that :meth:`frame`'s arrays view.)"""
        self.header = header = ps_pb2.PullHeader.FromString(header_bytes)
        if len(header.tensors) != 1:
            return None
        self.arrays = self._targets(header)
        if self.arrays[0].nbytes != n:
            raise InvalidArgumentError(
                f"pull reply of {n} bytes for {self.arrays[0].nbytes} announced"
            )
        return memoryview(framing.byte_view(self.arrays[0]))

    def frame(self, reply: tuple[bytes, memoryview]) -> list[tuple[np.ndarray, int]]:
        """``[(array, version), ...]`` of a data-plane reply (read through
        :meth:`sink` where given): the tensors view its one buffer (``out``'s are filled)."""
        header_bytes, payload = reply
        if self.header is None:  # no sink was asked
            self.header = ps_pb2.PullHeader.FromString(header_bytes)
        if self.arrays is None and self._out is not None:  # several tensors into out
            self.arrays = self._targets(self.header)
            filler = _Filler([framing.byte_view(a) for a in self.arrays])
            filler.feed(payload)
            filler.finish()
        elif self.arrays is None:  # slices of the one buffer (a copy where misaligned)
            self.arrays, pos = [], 0
            for t in self.header.tensors:  # each spec read, told and sliced in one pass
                dtype, shape = codec.dtype_from_wire(t.spec.dtype), tuple(t.spec.shape)
                if not self._rows:
                    self._seen(t.name, dtype, shape)
                end = pos + math.prod(shape) * dtype.itemsize
                if end > len(payload):
                    break
                arr = np.frombuffer(payload, dtype, math.prod(shape), pos).reshape(shape)
                self.arrays.append(arr if pos % dtype.itemsize == 0 else arr.copy())
                pos = end
            if len(self.arrays) != len(self.header.tensors) or pos != len(payload):
                raise InvalidArgumentError(
                    f"pull reply of {len(payload)} bytes does not hold the "
                    f"{len(self.header.tensors)} tensors its header announced"
                )
        return list(zip(self.arrays, [t.version for t in self.header.tensors]))


# -- the variables' list and the counters --------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VariableDescription:
    """A variable as the PS describes it."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    trainable: bool
    optimizer: dict[str, Any] | None
    slot_names: tuple[str, ...]
    version: int
    optimizer_step: int
    sync_step: int
    # the PS's shared-memory mirror of the value (same host), or "": where, not what
    shm_name: str = dataclasses.field(default="", compare=False)


def variables_reply(infos: Iterable[Any]) -> ps_pb2.ListVariablesResponse:
    """The ``ListVariablesResponse`` of a store's ``list_variables()``."""
    return ps_pb2.ListVariablesResponse(
        variables=[
            ps_pb2.VariableInfo(
                variable=ps_pb2.VariableSpec(
                    name=i.meta.name,
                    spec=codec.spec_to_proto(i.meta.dtype, i.meta.shape),
                    trainable=i.meta.trainable,
                    optimizer_json=i.optimizer_json,
                ),
                slot_names=i.slot_names,
                version=i.version,
                optimizer_step=i.optimizer_step,
                sync_step=i.sync_step,
                shm_name=i.shm_name,
            )
            for i in infos
        ]
    )


def variable_descriptions(reply: ps_pb2.ListVariablesResponse) -> list[VariableDescription]:
    """The variables a ``ListVariablesResponse`` describes."""
    out = []
    for info in reply.variables:
        v = info.variable
        dtype, shape, _ = codec.check_spec(v.spec.dtype, v.spec.shape, max_bytes=1 << 62)
        rule = json.loads(v.optimizer_json) if v.optimizer_json else None
        slots, steps = tuple(info.slot_names), (info.optimizer_step, info.sync_step)
        out.append(
            VariableDescription(
                v.name, dtype, shape, v.trainable, rule, slots, info.version, *steps, info.shm_name
            )
        )
    return out


def stats_reply(snapshot: dict[str, Any]) -> ps_pb2.GetStatsResponse:
    """The ``GetStatsResponse`` of a store's ``stats_snapshot()`` (its ``log`` entries included)."""
    log = [
        ps_pb2.PushLogEntry(
            variable=e.variable,
            client_id=e.client_id,
            base_version=e.base_version,
            applied_version=e.applied_version,
        )
        for e in snapshot.pop("log", [])
    ]
    return ps_pb2.GetStatsResponse(**snapshot, log=log)


def stats_from_reply(reply: ps_pb2.GetStatsResponse, include_log: bool) -> dict[str, Any]:
    """The counters of a ``GetStatsResponse`` (``log``: ``(variable, client, base, applied)``)."""
    out = {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields if f.name != "log"}
    out.update(rejected=dict(reply.rejected), staleness_histogram=dict(reply.staleness_histogram))
    if include_log:
        out["log"] = [
            (e.variable, e.client_id, e.base_version, e.applied_version) for e in reply.log
        ]
    return out
