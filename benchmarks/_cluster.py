"""Starting benchmark clusters of separate processes on loopback (psflow's and TensorFlow's).

With ``net`` (a :class:`_netns.VethPair`), the parameter servers run in its
namespace "a" and the workers in "b", so every push and pull crosses the veth
link as it would cross hosts; the caller (the chief) must then run in "b".

Every process is started with a bounded wait for readiness and killed and
reaped by :meth:`Processes.close` (also on errors, through ``with``). A killed
psflow process cannot remove its shared-memory segments (a PS's mirrors, a
client's push buffers: megabytes of RAM each under ``/dev/shm``), so ``close``
removes those of every psflow process that no longer runs, as a PS does when it
starts; so does this process's exit, for children a benchmark killed itself.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys

import _netns

from psflow import launch
from psflow.transport import shm

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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (0 where /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        if ready is None:
            proc = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=child_env(env),
                cwd=ROOT,
            )
            self.procs.append(proc)
            return proc, ""
        proc, line = launch.start_process(
            args,
            lambda line: line if line.startswith(ready) else None,
            env=child_env(env),
            cwd=ROOT,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
            what=f"{ready} line",
        )
        self.procs.append(proc)
        return proc, line

    def start_role(
        self,
        module: str,
        args: list[str],
        role: str,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> launch.Ready:
        """Starts a psflow role (``psflow.launch.start_role``); returns its ready line."""
        proc, ready = launch.start_role(
            module,
            args,
            role=role,
            env=child_env(env),
            cwd=ROOT,
            stderr=subprocess.DEVNULL,
            timeout=120.0,
            prefix=prefix or (),
        )
        self.procs.append(proc)
        return ready

    def close(self) -> None:
        """Kills and reaps every child, then removes the shared-memory segments they left."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.stdout:
                proc.stdout.close()
        self.procs.clear()
        shm.remove_stale()


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
        ready = procs.start_role(
            "ps_server",
            [
                "--port", "0", "--task", f"ps:{i}", "--log-level", "WARNING",
                "--bind", ps_host, "--shm", "off" if net else shm, *net_flags,
            ],
            "ps",
            env,
            prefix=net.exec_in("a", []) if net else None,
        )  # fmt: skip
        ps.append(f"{ps_host}:{ready.port}")
    workers = []
    for i in range(num_workers):
        args = [
            "--port", "0", "--task", f"worker:{i}", "--ps", ",".join(ps),
            "--workers", str(num_workers), "--log-level", "WARNING", "--bind", worker_host,
            *net_flags,
        ]  # fmt: skip
        ready = procs.start_role("worker", args, "worker", env)
        workers.append(f"{worker_host}:{ready.port}")
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


# children a benchmark killed without Processes (its own PS or chief): their segments too
atexit.register(shm.remove_stale)
