"""Two network namespaces joined by a veth link: a "cross-host" path on one machine.

On loopback the kernel short-cuts TCP and psflow takes its shared-memory fast
path; between pods on different nodes neither happens.  :class:`VethPair`
builds the closest thing one machine offers: namespaces ``<name>a`` and
``<name>b``, each with its own loopback, joined by a veth pair addressed in a
private /30 (:data:`SERVER_ADDR` in ``a``, :data:`CLIENT_ADDR` in ``b``).  The
addresses exist only inside the namespaces, so no traffic leaves them and the
host's own interfaces are untouched.

Lifecycle: ``with VethPair() as net:`` creates both namespaces and deletes them
on exit, on an exception, and on SIGTERM/SIGINT/SIGHUP (turned into
``SystemExit`` while the pair exists, so ``finally`` blocks run); ``atexit``
is the last resort.  Deleting a namespace deletes its end of the veth and with
it the other end.  Names carry the creator's pid, so concurrent runs do not
collide; :func:`remove_stale` deletes pairs whose creator is gone.

:meth:`VethPair.netem` adds delay and loss on both ends with ``tc netem``
(a round trip then takes twice the one-way delay); where the kernel has no
netem, :meth:`VethPair.drop` makes random loss with nftables.
:meth:`VethPair.set_link` takes one end down and up again: a partition that
heals.

Needs root and ``ip`` (``tc`` for netem); :func:`unavailable` says why not,
so callers can print a "skipped" line instead of failing.

Example (as root)::

    with VethPair() as net:
        ps = subprocess.Popen(net.exec_in("a", [sys.executable, "-m", "ps_server",
                                                "--bind", SERVER_ADDR, "--port", "0"]))
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence

__all__ = ["CLIENT_ADDR", "SERVER_ADDR", "VethPair", "remove_stale", "unavailable"]

SERVER_ADDR = "10.203.0.1"  # namespace "a"
CLIENT_ADDR = "10.203.0.2"  # namespace "b"
_PREFIX_LEN = 30
_NAME_PREFIX = "psfw"
_IP_TIMEOUT = 20.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT, check=check
    )


def unavailable(need_tc: bool = False) -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "not root"
    if shutil.which("ip") is None:
        return "no `ip` command"
    if need_tc and shutil.which("tc") is None:
        return "no `tc` command"
    try:
        probe = _ip("netns", "list", check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns list` failed: {e}"
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()[:200]}"
    return None


def remove_stale() -> list[str]:
    """Deletes namespaces this module created in processes that no longer exist."""
    removed = []
    listing = _ip("netns", "list", check=False).stdout.split()
    for name in listing:
        pid_text = name[len(_NAME_PREFIX) : -1].split("t")[0]
        if not name.startswith(_NAME_PREFIX) or not pid_text.isdigit():
            continue
        pid = int(pid_text)
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class VethPair:
    """Namespaces ``a`` (server side) and ``b`` (client side) joined by one veth link.

    Args:
        tag: distinguishes several pairs made by one process (0..9).

    Raises:
        RuntimeError: from ``__enter__`` when a command fails (what was
            created is deleted first).
    """

    def __init__(self, tag: int = 0, *, _pid: int | None = None) -> None:
        if not 0 <= tag <= 9:
            raise ValueError(f"tag must be 0..9, got {tag}")
        pid = os.getpid() if _pid is None else _pid
        base = f"{_NAME_PREFIX}{pid}t{tag}"
        self.names = {"a": f"{base}a", "b": f"{base}b"}
        # interface names are limited to 15 characters
        self._links = {side: f"pfv{pid % 100000}{tag}{side}" for side in ("a", "b")}
        self.addresses = {"a": SERVER_ADDR, "b": CLIENT_ADDR}
        self._created: list[str] = []
        self._old_handlers: dict[int, object] = {}

    @classmethod
    def attach(cls, base: str) -> VethPair:
        """A handle on a pair another process created (``base``: :attr:`base`); not owned:
        ``close`` leaves it in place."""
        pid, _, tag = base[len(_NAME_PREFIX) :].partition("t")
        if not base.startswith(_NAME_PREFIX) or not pid.isdigit() or not tag.isdigit():
            raise ValueError(f"not the base of a pair this module made: {base!r}")
        return cls(int(tag), _pid=int(pid))

    @property
    def base(self) -> str:
        """The common stem of the two namespace names (what :meth:`attach` takes)."""
        return self.names["a"][:-1]

    # --- lifecycle -------------------------------------------------------------
    def __enter__(self) -> VethPair:
        self._catch_signals()
        atexit.register(self.close)
        try:
            for side in ("a", "b"):
                _ip("netns", "add", self.names[side])
                self._created.append(self.names[side])
            _ip(
                "link", "add", self._links["a"], "netns", self.names["a"],
                "type", "veth", "peer", "name", self._links["b"], "netns", self.names["b"],
            )  # fmt: skip
            for side in ("a", "b"):
                ns, link = self.names[side], self._links[side]
                _ip("-n", ns, "addr", "add", f"{self.addresses[side]}/{_PREFIX_LEN}", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else str(e)
            self.close()
            raise RuntimeError(f"could not build the veth pair: {detail.strip()[:300]}") from e
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Deletes both namespaces (and so the link); safe to call twice."""
        while self._created:
            name = self._created.pop()
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                _ip("netns", "del", name, check=False)
        self._restore_signals()
        atexit.unregister(self.close)

    def _catch_signals(self) -> None:
        def leave(signum: int, _frame: object) -> None:
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(ValueError):  # not the main thread: atexit only
                self._old_handlers[sig] = signal.signal(sig, leave)

    def _restore_signals(self) -> None:
        for sig, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(sig, handler)
        self._old_handlers.clear()

    # --- use -----------------------------------------------------------------------
    def exec_in(self, side: str, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside namespace ``side`` ("a" or "b")."""
        return ["ip", "netns", "exec", self.names[side], *argv]

    def netem(self, delay_ms: float, loss_percent: float = 0.0) -> None:
        """Adds ``delay_ms`` one-way delay and ``loss_percent`` loss on both ends.

        Raises:
            RuntimeError: ``tc`` refused (e.g. a kernel without the netem qdisc),
                with its message.
        """
        for side in ("a", "b"):
            done = subprocess.run(
                [
                    "ip", "netns", "exec", self.names[side], "tc", "qdisc", "replace",
                    "dev", self._links[side], "root", "netem",
                    "delay", f"{delay_ms}ms", "loss", f"{loss_percent}%",
                ],
                capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise RuntimeError(f"tc netem on {self.names[side]}: {done.stderr.strip()[:200]}")

    def set_link(self, side: str, up: bool) -> None:
        """Sets ``side``'s end of the link down (a partition: nothing crosses) or up again.

        Sockets stay open on both sides; the kernel re-adds the route when the
        link comes back up, so TCP resumes by retransmission.
        """
        _ip("-n", self.names[side], "link", "set", self._links[side], "up" if up else "down")

    def drop(self, percent: int) -> None:
        """Drops ``percent``% of the packets arriving on each side, at random (nftables).

        For kernels without netem.  The rule sits on the input hook: a dropped
        packet is lost on the wire as far as the sender knows (an output-hook
        drop would fail the sender's call with EPERM instead).

        Raises:
            RuntimeError: ``nft`` is missing or the kernel refused the rule, with its message.
        """
        if not 0 <= percent <= 100:
            raise ValueError(f"percent must be 0..100, got {percent!r}")
        if shutil.which("nft") is None:
            raise RuntimeError("no `nft` command")
        for side in ("a", "b"):
            for rule in (
                ["add", "table", "inet", "psflow_fault"],
                ["add", "chain", "inet", "psflow_fault", "input",
                 "{ type filter hook input priority 0; }"],
                ["add", "rule", "inet", "psflow_fault", "input",
                 "numgen", "random", "mod", "100", "<", str(percent), "counter", "drop"],
            ):  # fmt: skip
                done = subprocess.run(
                    ["ip", "netns", "exec", self.names[side], "nft", *rule],
                    capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False,
                )  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"nft on {self.names[side]}: {done.stderr.strip()[:200]}")

    def dropped(self) -> int:
        """Packets :meth:`drop`'s rules have dropped so far, both sides (0 without rules)."""
        total = 0
        for side in ("a", "b"):
            done = subprocess.run(
                ["ip", "netns", "exec", self.names[side], "nft", "-j", "list", "table", "inet",
                 "psflow_fault"],
                capture_output=True, text=True, timeout=_IP_TIMEOUT, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                continue
            for item in json.loads(done.stdout).get("nftables", []):
                for expr in item.get("rule", {}).get("expr", []):
                    total += expr.get("counter", {}).get("packets", 0)
        return total

    def exists(self) -> bool:
        """Whether both namespaces currently exist."""
        listing = _ip("netns", "list", check=False).stdout.split()
        return all(name in listing for name in self.names.values())
