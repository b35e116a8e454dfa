"""Starting benchmark clusters of separate processes on loopback (psflow's and TensorFlow's).

With ``net`` (a :class:`_netns.VethPair`), the parameter servers run in its
namespace "a" and the workers in "b", so every push and pull crosses the veth
link as it would cross hosts; the caller (the chief) must then run in "b".

Every process is started with a bounded wait for readiness and killed and
reaped by :meth:`Processes.close` (also on errors, through ``with``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import selectors
import socket
import subprocess
import sys
import time

import _netns

ROOT = pathlib.Path(__file__).resolve().parent.parent


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This checkout first on PYTHONPATH, unbuffered output, plus ``extra``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def free_ports(n: int) -> list[int]:
    """``n`` currently free loopback ports."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


class Processes:
    """Children of a benchmark; ``with Processes() as p: p.start(...)``."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(
        self,
        args: list[str],
        ready: str | None,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
    ) -> tuple[subprocess.Popen, str]:
        """Starts ``args``; with ``ready``, waits for a stdout line starting with it (returned)."""
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=child_env(env), cwd=ROOT
        )
        self.procs.append(proc)
        if ready is None:
            return proc, ""
        deadline = time.monotonic() + timeout
        buffer = b""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline and proc.poll() is None:
                if not sel.select(0.5):
                    continue
                buffer += os.read(proc.stdout.fileno(), 4096)
                for line in buffer.decode(errors="replace").splitlines():
                    if line.startswith(ready):
                        return proc, line
        raise RuntimeError(f"{args[:4]} not ready within {timeout}s (exit {proc.poll()})")

    def close(self) -> None:
        """Kills and reaps every child."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.stdout:
                proc.stdout.close()
        self.procs.clear()


def psflow_cluster(
    procs: Processes,
    num_ps: int,
    num_workers: int,
    env: dict[str, str] | None = None,
    net: _netns.VethPair | None = None,
    shm: str = "auto",
) -> dict[str, list[str]]:
    """Starts psflow PS and worker processes; returns the cluster dict (without the chief).

    ``shm`` is the PS's ``--shm`` flag; across ``net`` it is always off.
    """
    ps_host = _netns.SERVER_ADDR if net else "127.0.0.1"
    worker_host = _netns.CLIENT_ADDR if net else "127.0.0.1"
    # private namespaces: nobody else can reach these addresses
    net_flags = ["--insecure"] if net else []
    ps = []
    for i in range(num_ps):
        _, line = procs.start(
            (net.exec_in("a", []) if net else [])
            + [
                sys.executable,
                "-m",
                "ps_server",
                "--port",
                "0",
                "--task",
                f"ps:{i}",
                "--log-level",
                "WARNING",
                "--bind",
                ps_host,
                "--shm",
                "off" if net else shm,
                *net_flags,
            ],
            "PSFLOW_READY ps",
            env,
        )
        ps.append(f"{ps_host}:" + dict(f.split("=", 1) for f in line.split() if "=" in f)["port"])
    workers = []
    for i in range(num_workers):
        args = [
            sys.executable,
            "-m",
            "worker",
            "--port",
            "0",
            "--task",
            f"worker:{i}",
            "--ps",
            ",".join(ps),
            "--workers",
            str(num_workers),
            "--log-level",
            "WARNING",
            "--bind",
            worker_host,
            *net_flags,
        ]
        _, line = procs.start(args, "PSFLOW_READY worker", env)
        workers.append(
            f"{worker_host}:" + dict(f.split("=", 1) for f in line.split() if "=" in f)["port"]
        )
    return {"ps": ps, "worker": workers}


TF_SERVER = """
import json, sys
import tensorflow as tf
spec = json.loads(sys.argv[1])
server = tf.distribute.Server(
    tf.train.ClusterSpec(spec), job_name=sys.argv[2], task_index=int(sys.argv[3]), protocol="grpc", start=True
)
print("TF_READY", flush=True)
server.join()
"""


def tf_cluster(
    procs: Processes,
    num_ps: int,
    num_workers: int,
    env: dict[str, str] | None = None,
    net: _netns.VethPair | None = None,
) -> dict[str, list[str]]:
    """Starts TensorFlow ps and worker servers; returns the cluster dict (with a chief address).

    Across ``net``: ps tasks in namespace "a", workers (and the chief's address) in "b".
    """
    ports = free_ports(num_ps + num_workers + 1)
    ps_host = _netns.SERVER_ADDR if net else "127.0.0.1"
    worker_host = _netns.CLIENT_ADDR if net else "127.0.0.1"
    spec = {
        "ps": [f"{ps_host}:{p}" for p in ports[:num_ps]],
        "worker": [f"{worker_host}:{p}" for p in ports[num_ps : num_ps + num_workers]],
        "chief": [f"{worker_host}:{ports[-1]}"],
    }
    for job in ("ps", "worker"):
        prefix = net.exec_in("a", []) if net and job == "ps" else []
        for i in range(len(spec[job])):
            procs.start(
                [*prefix, sys.executable, "-c", TF_SERVER, json.dumps(spec), job, str(i)],
                "TF_READY",
                env,
                timeout=180,
            )
    return spec
