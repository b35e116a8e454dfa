"""Seeded fuzzing of a live PS and a live worker, both requiring a token.

Over 10,000 generated requests, bounded in time: protobuf messages with random
field values, random raw bytes through generic calls, truncated frames, huge
declared shapes, wrong dtypes, out-of-range indices, unknown methods, bad or
missing tokens, and the hostile fields of issue 21 (empty shapes with huge
dimensions, 400-digit and deeply nested optimizer JSON, names and ids of
kilobytes, unbounded sync steps, bad checkpoint paths, foreign shared-memory
segments, closures whose exceptions misbehave).  Afterwards both processes are
up and healthy, every reply was a proper gRPC status from an expected set
(never INTERNAL, UNKNOWN or UNAVAILABLE), a control variable is unchanged,
and the PS's resident memory grew by less than 50 MB.  The status counts are
printed (``pytest -s``).

The control variable is named only by requests that must be refused: ones with
a wrong token (otherwise valid, so a hole in authentication would change it),
or with a flaw the PS must reject (dtype, shape, truncated payload, bad row).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import random
import time
from collections.abc import Iterator

import cloudpickle
import grpc
import numpy as np
import pytest

from psflow.proto import ps_pb2, tensor_pb2, worker_pb2
from psflow.security.config import SecurityConfig
from psflow.transport import framing
from psflow.transport.client import PSClient
from psflow.transport.service import METHODS, method_path
from tests.conftest import start_server

log = logging.getLogger(__name__)

SEED = 20240611
PS_REQUESTS = 8_000
WORKER_REQUESTS = 3_000
TIME_BUDGET = 90.0  # seconds for everything; on 2 cores it takes about a third of that
CALL_TIMEOUT = 5.0

TOKEN = "fuzz-token-0123456789abcdef"
GOOD_MD = (("authorization", f"Bearer {TOKEN}"),)
BAD_MDS = [
    None,
    (("authorization", "Bearer wrong-token-0123456789ab"),),
    (("authorization", TOKEN),),
    (("authorization", f"Bearer {TOKEN[:-1]}"),),
    (("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer x")),
    (("authorization", "Bearer " + "A" * 4000),),
]
CONTROL = "control"
CONTROL_VALUE = np.arange(8, dtype=np.float32) * 1.5
FUZZ_VARS = {
    "f_dense": ((4, 3), np.float32, True),
    "f_double": ((5,), np.float64, True),
    "f_rows": ((6, 2), np.float32, True),
    "f_ints": ((3,), np.int64, False),
}
DTYPES = {1: 2, 2: 4, 3: 8, 4: 1, 5: 2, 6: 4, 7: 8, 8: 1, 9: 1}  # wire code -> itemsize
PS_ALLOWED = {
    "OK",
    "DATA_LOSS",  # hostile restores
    "PERMISSION_DENIED",  # hostile checkpoint directories
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "ALREADY_EXISTS",
    "ABORTED",
    "UNAUTHENTICATED",
    "UNIMPLEMENTED",
    "DEADLINE_EXCEEDED",  # a sync push waiting for contributions that never come
}
WORKER_ALLOWED = {
    "OK",
    "INVALID_ARGUMENT",
    "RESOURCE_EXHAUSTED",
    "UNAUTHENTICATED",
    "UNIMPLEMENTED",
}
RSS_GROWTH_LIMIT = 50 << 20
WARMUP_REQUESTS = 500
SHM_DIRECTORY = f"psflow-{os.getpid()}-0badc0de-dir-{'0' * 32}"  # a directory, not a segment
HUGE_LR = '{"name": "sgd", "learning_rate": 1' + "0" * 400 + "}"
DEEP_JSON = "[" * 100_000 + "]" * 100_000
HOSTILE_OPTIMIZERS = [
    HUGE_LR,
    '{"name": "sgd", "momentum": 1' + "0" * 400 + "}",
    DEEP_JSON,
    '{"name": "sgd", "x": ' + "[" * 50_000 + "]" * 50_000 + "}",
    '{"name": "sgd", "learning_rate": 1e999}',
    '{"name": "adam", "epsilon": 1' + "0" * 5000 + "}",
]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


class _Sender:
    """Sends raw requests through generic calls and records the status of each."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(
            address, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self._calls: dict[tuple[str, str], object] = {}
        self.codes: collections.Counter[str] = collections.Counter()
        self.by_label: collections.Counter[tuple[str, str]] = collections.Counter()
        self.examples: dict[str, str] = {}

    def send(self, path: str, kind: str, payload, metadata, label: str) -> str:
        call = self._calls.get((path, kind))
        if call is None:
            call = self._calls[(path, kind)] = getattr(self.channel, kind)(path)
        try:
            if kind == "stream_unary":
                messages = [payload] if isinstance(payload, bytes) else payload
                call(iter(messages), metadata=metadata, timeout=CALL_TIMEOUT)
            elif kind == "unary_stream":
                for _ in call(payload, metadata=metadata, timeout=CALL_TIMEOUT):
                    pass
            else:
                call(payload, metadata=metadata, timeout=CALL_TIMEOUT)
            code = "OK"
        except grpc.RpcError as e:
            code = e.code().name
            if not e.details():
                code += " (no details)"
        self.codes[code] += 1
        self.by_label[(label, code)] += 1
        self.examples.setdefault(code, f"{label} {path}")
        return code

    def close(self) -> None:
        self.channel.close()


# -- PS requests ---------------------------------------------------------------------------
class PSFuzzer:
    """Generates ``(method, payload, metadata, label)`` for the ParameterServer service."""

    def __init__(self, rng: random.Random, tmp: str = "/nonexistent") -> None:
        self.rng = rng
        self.seq = 0
        self.tmp = tmp

    def _name(self) -> str:
        r = self.rng
        return r.choice(
            [
                *FUZZ_VARS,
                *FUZZ_VARS,
                "missing",
                "",
                "f_" + "x" * 300,
                "ünï/cødé",
                f"fz{r.randrange(8)}",
                "long" + "n" * r.choice([1021, 1025, 20_000]),  # at, above the name limit
            ]
        )

    def _shape(self) -> list[int]:
        r = self.rng
        pick = r.random()
        if pick < 0.05:  # empty, with a dimension NumPy cannot index
            return r.choice([[0, 2**63 - 1], [2**62, 0], [0, 1 << 40, 1 << 40]])
        if pick < 0.1:
            return [r.choice([1 << 40, 1 << 62, 2**63 - 1])]
        if pick < 0.2:
            return [r.randint(-3, 6) for _ in range(r.randint(1, 3))]
        if pick < 0.25:
            return [1] * r.choice([33, 40])  # rank above the maximum
        return [r.randint(0, 6) for _ in range(r.randint(0, 3))]

    def _payload(self, nbytes: int) -> bytes:
        r = self.rng
        if nbytes > 1 << 16 or nbytes < 0:
            nbytes = r.randint(0, 64)
        nbytes = max(0, nbytes + r.choice([0, 0, 0, 0, -1, 1, -4, 8]))
        return r.randbytes(nbytes)

    def _push_header(self, items, *, control: bool = False) -> ps_pb2.PushHeader:
        r = self.rng
        header = ps_pb2.PushHeader(items=items)
        self.seq += 1
        header.id.client_id = r.choice(
            ["fuzz", "fuzz", "other", "", f"id{r.randrange(1000)}-" + "c" * r.choice([100, 5000])]
        )
        header.id.sequence = r.choice([self.seq, self.seq, 0, r.randrange(1 << 40)])
        if not control and r.random() < 0.15:
            header.step = r.randint(-2, 20)
            header.num_required = r.choice([-1, 0, 1, 2, 3, 2**31 - 1])
            header.wait_applied = r.random() < 0.05 and header.num_required == 1
        if r.random() < 0.03:  # a foreign shared-memory segment, or a path
            header.shm_payload = r.choice(
                ["../../etc/passwd", "/dev/shm/x", f"psflow-1-deadbeef-p1-{'0' * 32}",
                 f"psflow-{os.getpid()}-0badc0de-x", SHM_DIRECTORY]
            )  # fmt: skip
        if r.random() < 0.1:
            header.max_staleness = r.randint(-1, 3)
        return header

    def push(self) -> tuple[str, object, object, str]:
        """A Push or PushStream with random items (often malformed)."""
        r = self.rng
        items, payload = [], b""
        for _ in range(r.choice([1, 1, 1, 2, 3, 0])):
            name = self._name()
            if name in FUZZ_VARS and r.random() < 0.5:
                shape, dtype, _ = FUZZ_VARS[name]
                code = 2 if dtype == np.float32 else 3 if dtype == np.float64 else 7
                shape = list(shape)
            else:
                code, shape = r.choice([*DTYPES, 0, 42, -1]), self._shape()
            item = ps_pb2.PushItem(name=name, base_version=r.randint(-1, 5))
            item.values.dtype, item.values.shape[:] = code, shape
            item.sparse = r.random() < 0.3
            count = 1
            for d in shape:
                count *= max(d, 0)
            if item.sparse and shape and 0 <= shape[0] <= 64:
                rows = [r.randint(-2, 8) for _ in range(shape[0])]
                payload += np.array(rows, "<i8").tobytes()
            payload += self._payload(count * DTYPES.get(code, 4))
            items.append(item)
        header = self._push_header(items).SerializeToString()
        return self._framed("Push", header, payload)

    def _framed(self, method: str, header: bytes, payload: bytes):
        r = self.rng
        pick = r.random()
        if pick < 0.55:
            return method, framing.encode_message(header, [payload]), GOOD_MD, "framed"
        if pick < 0.7:  # truncated frame
            raw = framing.encode_message(header, [payload])
            return method, raw[: r.randrange(max(len(raw), 1))], GOOD_MD, "truncated"
        # streamed: the payload in pieces, sometimes with a second header or missing the first
        pieces = [payload[i : i + 7] for i in range(0, len(payload), 7)] or [b""]
        messages = [framing.encode_message(header, [pieces[0]])]
        messages += [framing.encode_message(None, [p]) for p in pieces[1:]]
        if r.random() < 0.2:
            messages.insert(r.randrange(len(messages) + 1), framing.encode_message(header, []))
        if r.random() < 0.1:
            messages = messages[1:]
        if r.random() < 0.1:
            messages.append(r.randbytes(r.randint(0, 32)))
        return method + "Stream", messages, GOOD_MD, "streamed"

    def write(self):
        """A Write or WriteStream (create, assign, add, sub, junk ops) with random specs."""
        r = self.rng
        op = r.choice([0, 1, 1, 2, 3, 4, 9, -1])
        specs, payload = [], b""
        for _ in range(r.choice([1, 1, 2, 0])):
            code, shape = r.choice([*DTYPES, 0, 77]), self._shape()
            name = self._name()
            if op == 1 and r.random() < 0.3:
                name = f"fz{r.randrange(12)}"
            spec = ps_pb2.VariableSpec(name=name, trainable=r.random() < 0.7)
            spec.spec.dtype, spec.spec.shape[:] = code, shape
            spec.optimizer_json = r.choice(
                ["", '{"name": "sgd"}', "{bad", "[1]", '{"name": "nope"}']
                if r.random() < 0.9
                else HOSTILE_OPTIMIZERS
            )
            count = 1
            for d in shape:
                count *= max(d, 0)
            payload += self._payload(count * DTYPES.get(code, 4))
            specs.append(spec)
        header = ps_pb2.WriteHeader(op=op if op >= 0 else 7, variables=specs)
        if r.random() < 0.5:
            self.seq += 1
            header.id.client_id, header.id.sequence = "fuzzw", self.seq
        return self._framed("Write", header.SerializeToString(), payload)

    def pull(self):
        """Pull or PullStream with random names and row indices (often out of range)."""
        r = self.rng
        items = []
        for _ in range(r.choice([0, 1, 1, 2, 4])):
            item = ps_pb2.PullItem(name=r.choice([*FUZZ_VARS, CONTROL, "missing", ""]))
            if r.random() < 0.4:
                n = r.randint(0, 5)
                code = r.choice([7, 7, 7, 6, 2, 0, 99])
                item.indices.dtype, item.indices.shape[:] = code, r.choice([[n], [n, 1], [1 << 40]])
                rows = [r.randint(-3, 9) for _ in range(n)]
                data = np.array(rows, "<i8").tobytes()
                item.indices.data = data[: r.choice([len(data), len(data), max(len(data) - 3, 0)])]
            items.append(item)
        request = ps_pb2.PullRequest(items=items, chunk_bytes=r.choice([0, 1, 4096, -5, 1 << 40]))
        return r.choice(["Pull", "PullStream"]), request.SerializeToString(), GOOD_MD, "pull"

    def other(self):
        """ConfigureOptimizer, ListVariables, GetStats, Restore with random fields."""
        r = self.rng
        pick = r.random()
        if pick < 0.4:
            config = r.choice(
                [
                    {"name": "sgd", "learning_rate": r.uniform(-1, 1)},
                    {"name": "adam"},
                    {"name": "momentum", "momentum": "fast"},
                    {"name": r.choice(["x", "", "SGD"])},
                    [1, 2],
                    "sgd",
                ]
            )
            names = [r.choice([*FUZZ_VARS, "missing", ""]) for _ in range(r.randint(0, 3))]
            text = json.dumps(config) if r.random() < 0.9 else "{not json"
            if r.random() < 0.1:
                text = r.choice(HOSTILE_OPTIMIZERS)
            request = ps_pb2.ConfigureOptimizerRequest(names=names, optimizer_json=text)
            return "ConfigureOptimizer", request.SerializeToString(), GOOD_MD, "configure"
        if pick < 0.6:
            request = ps_pb2.RestoreRequest(
                directory=r.choice(["", "/nonexistent/psflow-fuzz", "relative/none",
                                    *self._hostile_dirs()]),
                prefix=r.choice(["", "ps-0", "../x", "p" * 300, "saved"]),
            )  # fmt: skip
            if r.random() < 0.2:  # (naming one that exists would restore only it)
                request.names[:] = [r.choice(["missing", "m" * 5000])]
            return "Restore", request.SerializeToString(), GOOD_MD, "restore"
        if pick < 0.7:
            request = ps_pb2.SaveRequest(
                directory=r.choice(["", *self._hostile_dirs()]),
                prefix=r.choice(["", "../x", "p" * 300, "a\0b", "saved"]),
                step=r.choice([0, 1, -1, 2**62]),
            )
            return "Save", request.SerializeToString(), GOOD_MD, "save"
        if pick < 0.85:
            request = ps_pb2.GetStatsRequest(include_log=r.random() < 0.2)
            return "GetStats", request.SerializeToString(), GOOD_MD, "stats"
        return "ListVariables", r.randbytes(r.randint(0, 8)), GOOD_MD, "list"

    def _hostile_dirs(self) -> list[str]:
        """Checkpoint directories that cannot hold a checkpoint (and one that can)."""
        a_file = os.path.join(self.tmp, "a-file")
        return [
            os.path.join(self.tmp, "a\0b"),
            a_file,
            os.path.join(a_file, "below"),
            os.path.join(self.tmp, "n" * 5000),
            os.path.join(self.tmp, "n" * 300, "x"),
            os.path.join(self.tmp, "missing", "sub"),
            os.path.join(self.tmp, "ckpt"),
        ]

    def raw(self):
        """Random bytes to a random method, or a call to a method that does not exist."""
        r = self.rng
        method = r.choice([*METHODS, "Nope", "Push "])
        size = r.choice([0, 1, 5, 64, 300, 4096, 1 << 20]) if r.random() < 0.98 else 4 << 20
        return method, r.randbytes(size), GOOD_MD, "raw"

    def control(self):
        """A request naming the control variable that must be refused."""
        r = self.rng
        value = np.ones(8, np.float32)
        item = ps_pb2.PushItem(name=CONTROL, base_version=-1)
        item.values.dtype, item.values.shape[:] = 2, [8]
        header = self._push_header([item], control=True).SerializeToString()
        valid = framing.encode_message(header, [value.tobytes()])
        flaw = r.choice(["token", "token", "dtype", "shape", "truncated", "row", "assign"])
        if flaw == "token":  # valid in every other way
            method = r.choice(["Push", "Write"])
            if method == "Write":
                spec = ps_pb2.VariableSpec(name=CONTROL)
                spec.spec.dtype, spec.spec.shape[:] = 2, [8]
                wh = ps_pb2.WriteHeader(op=r.choice([2, 3, 4]), variables=[spec])
                wh.id.client_id, wh.id.sequence = "intruder", r.randrange(1 << 30)
                valid = framing.encode_message(wh.SerializeToString(), [value.tobytes()])
            return method, valid, r.choice(BAD_MDS), "control-token"
        if flaw == "dtype":
            item.values.dtype = 3
            raw = framing.encode_message(
                self._push_header([item], control=True).SerializeToString(),
                [np.ones(8).tobytes()],
            )
        elif flaw == "shape":
            item.values.shape[:] = [2, 4]
            raw = framing.encode_message(
                self._push_header([item], control=True).SerializeToString(), [value.tobytes()]
            )
        elif flaw == "truncated":
            raw = framing.encode_message(header, [value.tobytes()[: r.randrange(32)]])
        elif flaw == "row":
            item.sparse, item.values.shape[:] = True, [1, 8]
            raw = framing.encode_message(
                self._push_header([item], control=True).SerializeToString(),
                [np.array([r.choice([-1, 8, 1 << 40])], "<i8").tobytes(), value.tobytes()],
            )
        else:
            spec = ps_pb2.VariableSpec(name=CONTROL)
            spec.spec.dtype, spec.spec.shape[:] = 2, [r.choice([7, 9, 0])]
            wh = ps_pb2.WriteHeader(op=2, variables=[spec])
            raw = framing.encode_message(wh.SerializeToString(), [r.randbytes(28)])
            return "Write", raw, GOOD_MD, "control-assign"
        return "Push", raw, GOOD_MD, f"control-{flaw}"

    def __iter__(self) -> Iterator[tuple[str, object, object, str]]:
        generators = [
            (self.push, 30),
            (self.write, 15),
            (self.pull, 15),
            (self.other, 10),
            (self.raw, 15),
            (self.control, 15),
        ]
        funcs = [g for g, _ in generators]
        weights = [w for _, w in generators]
        while True:
            yield self.rng.choices(funcs, weights)[0]()


def _kind(method: str) -> str:
    return METHODS[method][0].value if method in METHODS else "unary_unary"


# -- worker requests ---------------------------------------------------------------------------
def _harmless_functions() -> list[bytes]:
    import sys

    from psflow import errors

    def fails():
        raise ValueError("fuzz")

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    def bad_str():
        raise Unprintable()

    def surrogate():
        raise ValueError("lone \ud800")

    def int_code():
        e = errors.InvalidArgumentError("int code")
        e.code = 3
        raise e

    def exits():
        sys.exit(1)

    def interrupts():
        raise KeyboardInterrupt

    return [
        cloudpickle.dumps(lambda: 1),
        cloudpickle.dumps(fails),
        cloudpickle.dumps(lambda x=0: x + 1),
        cloudpickle.dumps(len),
        cloudpickle.dumps(3),  # not callable
        *(cloudpickle.dumps(f) for f in (bad_str, surrogate, int_code, exits, interrupts)),
    ]


class WorkerFuzzer:
    """Generates ``(method, payload, metadata, label)`` for the Worker service."""

    def __init__(self, rng: random.Random, ps_address: str) -> None:
        self.rng = rng
        self.functions = _harmless_functions()

        def push_control(address=ps_address, token=TOKEN):  # must never run
            import numpy as np

            from psflow.security.config import SecurityConfig
            from psflow.transport.client import PSClient

            with PSClient(address, security=SecurityConfig(token=token), timeout=5) as c:
                c.push({"control": np.ones(8, np.float32)})

        self.intruder = cloudpickle.dumps(push_control)

    def run_closure(self):
        r = self.rng
        request = worker_pb2.RunClosureRequest(
            session_id=r.choice(
                [
                    "s1",
                    "s2",
                    "",
                    "ß" * 3,
                    f"s{r.randrange(50)}",
                    f"h{r.randrange(500)}",
                    "L" * r.choice([1024, 2000, 100_000]),
                ]
            ),
            closure_id=r.randrange(1 << 20),
            function_key=r.choice(["", "k1", "once-x", f"k{r.randrange(20)}", "once-"]),
            resource_key=r.choice(["", "", "", "res", f"r{r.randrange(5)}"]),
            step=r.choice([0, 0, 1, -5, 1 << 40]),
        )
        pick = r.random()
        if pick < 0.35:
            request.function = r.choice(self.functions)
        elif pick < 0.6:
            request.function = r.randbytes(r.randint(0, 200))
        elif pick < 0.65:
            request.function = r.randbytes(70_000)  # above --max-closure-bytes
        if r.random() < 0.5:
            request.arguments = r.choice(
                [
                    cloudpickle.dumps(((), {})),
                    cloudpickle.dumps(((1,), {})),
                    cloudpickle.dumps(((), {"x": 2})),
                    r.randbytes(r.randint(0, 100)),
                    cloudpickle.dumps("not a tuple"),
                ]
            )
        return "RunClosure", request.SerializeToString(), GOOD_MD, "run"

    def __iter__(self) -> Iterator[tuple[str, object, object, str]]:
        r = self.rng
        while True:
            pick = r.random()
            if pick < 0.55:
                yield self.run_closure()
            elif pick < 0.65:
                request = worker_pb2.EndSessionRequest(session_id=r.choice(["s1", "", "zz"]))
                yield "EndSession", request.SerializeToString(), GOOD_MD, "end"
            elif pick < 0.7:
                yield "GetStatus", b"", GOOD_MD, "status"
            elif pick < 0.85:
                method = r.choice(["RunClosure", "EndSession", "GetStatus", "Nope"])
                yield method, r.randbytes(r.choice([1, 7, 100, 3000])), GOOD_MD, "raw"
            else:  # an otherwise valid closure that would push to the control, bad token
                request = worker_pb2.RunClosureRequest(
                    session_id="intruder", closure_id=1, function_key="once-i",
                    function=self.intruder,
                )  # fmt: skip
                yield "RunClosure", request.SerializeToString(), r.choice(BAD_MDS), "token"


# -- the run ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("fuzz")
    (log_dir / "a-file").write_text("not a directory")
    env = {"PSFLOW_AUTH_TOKEN": TOKEN}
    started = []
    shm_dir = os.path.join("/dev/shm", SHM_DIRECTORY)
    if os.path.isdir("/dev/shm"):
        os.makedirs(shm_dir, exist_ok=True)
    try:
        ps = start_server(
            "ps_server",
            ["--port", "0", "--max-tensor-bytes", str(1 << 20), "--max-variables", "64",
             "--log-level", "WARNING"],
            "PSFLOW_READY ps",
            log_dir=log_dir,
            env=env,
        )  # fmt: skip
        started.append(ps)
        worker = start_server(
            "worker",
            ["--port", "0", "--ps", ps.address, "--workers", "1",
             "--max-closure-bytes", "65536", "--log-level", "WARNING"],
            "PSFLOW_READY worker",
            log_dir=log_dir,
            env=env,
        )  # fmt: skip
        started.append(worker)
        with PSClient(ps.address, security=SecurityConfig(token=TOKEN), timeout=30) as client:
            client.create_variable(CONTROL, CONTROL_VALUE, optimizer={"name": "sgd"})
            for name, (shape, dtype, trainable) in FUZZ_VARS.items():
                client.create_variable(
                    name,
                    np.ones(shape, dtype),
                    trainable=trainable,
                    optimizer={"name": "sgd"} if trainable else None,
                )
        yield ps, worker, str(log_dir)
    finally:
        for server in started:
            server.reap()
        if os.path.isdir(shm_dir):
            os.rmdir(shm_dir)


def _summary(sender: _Sender) -> str:
    by_label = {f"{label} {code}": n for (label, code), n in sorted(sender.by_label.items())}
    return json.dumps({"codes": dict(sender.codes), "by_label": by_label}, indent=1)


@pytest.mark.slow
def test_fuzz_ps_and_worker(targets):
    ps, worker, tmp = targets
    rng = random.Random(SEED)
    deadline = time.monotonic() + TIME_BUDGET
    ps_sender, worker_sender = _Sender(ps.address), _Sender(worker.address)
    rss_start = rss_before = _rss_bytes(ps.proc.pid)
    try:
        for n, (method, payload, metadata, label) in enumerate(PSFuzzer(rng, tmp)):
            if n == PS_REQUESTS or time.monotonic() > deadline:
                break
            if n == WARMUP_REQUESTS:  # thread pool, caches and arenas in place: the baseline
                rss_before = _rss_bytes(ps.proc.pid)
            path = method_path(method) if method in METHODS or method == "Nope" else f"/x/{method}"
            code = ps_sender.send(path, _kind(method), payload, metadata, label)
            if label.startswith("control"):
                assert code != "OK", f"{label} request to the control variable was accepted"
        for n, (method, payload, metadata, label) in enumerate(WorkerFuzzer(rng, ps.address)):
            if n == WORKER_REQUESTS or time.monotonic() > deadline:
                break
            code = worker_sender.send(
                f"/psflow.v1.Worker/{method}", "unary_unary", payload, metadata, label
            )
            if label == "token":
                assert code == "UNAUTHENTICATED", code
    finally:
        ps_sender.close()
        worker_sender.close()
    total = sum(ps_sender.codes.values()) + sum(worker_sender.codes.values())
    time.sleep(1.0)  # let the allocator settle (freed arenas trimmed)
    rss_growth = _rss_bytes(ps.proc.pid) - rss_before
    print(
        f"fuzz: {total} calls; PS RSS growth {rss_growth / 2**20:.1f} MB after the first "
        f"{WARMUP_REQUESTS} calls, {(rss_growth + rss_before - rss_start) / 2**20:.1f} MB in all"
    )
    print("PS status counts:", dict(ps_sender.codes))
    print("worker status counts:", dict(worker_sender.codes))
    log.info("PS: %s\nworker: %s", _summary(ps_sender), _summary(worker_sender))
    assert sum(ps_sender.codes.values()) == PS_REQUESTS, "time budget ran out: " + _summary(
        ps_sender
    )
    assert sum(worker_sender.codes.values()) == WORKER_REQUESTS, _summary(worker_sender)
    assert total >= 10_000
    # every reply a proper status from the expected set, with details
    assert set(ps_sender.codes) <= PS_ALLOWED, _summary(ps_sender)
    assert set(worker_sender.codes) <= WORKER_ALLOWED, _summary(worker_sender)
    # the fuzzer reached deep enough to be accepted sometimes and refused for many reasons
    for code in ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED"):
        assert ps_sender.codes[code] > 20, _summary(ps_sender)
    for code in ("OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED"):
        assert worker_sender.codes[code] > 20, _summary(worker_sender)
    accepted_writes = sum(
        n for (label, code), n in ps_sender.by_label.items()
        if code == "OK" and label in ("framed", "streamed")
    )  # fmt: skip
    assert accepted_writes > 20, _summary(ps_sender)  # some random pushes/writes were valid
    # both processes are up and serving, the control variable unchanged, both still work
    assert ps.proc.poll() is None and worker.proc.poll() is None
    assert rss_growth < RSS_GROWTH_LIMIT, f"PS RSS grew by {rss_growth} bytes"
    assert "Traceback" not in ps.log_tail(5000) and "Traceback" not in worker.log_tail(5000)
    security = SecurityConfig(token=TOKEN)
    with PSClient(ps.address, security=security, timeout=30) as client:
        assert client.health() == "SERVING"
        np.testing.assert_array_equal(client.pull(CONTROL), CONTROL_VALUE)
        client.assign("f_double", np.zeros(5))
        client.configure_optimizer(["f_double"], {"name": "sgd", "learning_rate": 1.0})
        client.push({"f_double": np.full(5, 2.0)})
        np.testing.assert_array_equal(client.pull("f_double"), np.full(5, -2.0))
    from psflow.distribute.coordinator.workers import GrpcWorker

    status_client = GrpcWorker(0, worker.address, security=security)
    try:
        request = worker_pb2.RunClosureRequest(
            session_id="after", closure_id=1, function_key="once-ok",
            function=cloudpickle.dumps(lambda: "alive"),
        )  # fmt: skip
        reply = status_client._call(status_client._stub.RunClosure, request, 30)
        assert cloudpickle.loads(reply.result) == "alive"
        assert "intruder" not in status_client.status().session_ids
    finally:
        status_client.close()
    assert tensor_pb2.DataType.Name(2) == "DATA_TYPE_FLOAT32"  # the codes used above
