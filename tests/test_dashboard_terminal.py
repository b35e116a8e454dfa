"""``psflow local --status``: a table redrawn in place on a terminal, plain lines elsewhere.

The launcher runs for real (1 PS, 1 worker, a chief script printing ticks); the
terminal case gives it a pseudo-terminal and reads exactly what it drew.
"""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from psflow.dashboard.terminal import EraseBeforeWrite, StatusView, status_table
from tests.conftest import ROOT, child_env

TICKS = 8
TICK_SCRIPT = (
    "import time\n"
    f"for i in range({TICKS}):\n"
    "    print(f'tick {i}', flush=True)\n"
    "    time.sleep(0.4)\n"
)

DOC = {
    "ps": [
        {
            "task": "ps:0",
            "state": "up",
            "variables": 3,
            "variable_bytes": 2048,
            "pushes_per_second": 5.0,
            "pulls_per_second": 1.0,
        }
    ],
    "workers": [
        {
            "task": "worker:0",
            "state": "running",
            "closures_run": 4,
            "closures_failed": 1,
            "heartbeat_age_seconds": 0.2,
        }
    ],
}


def launcher_argv(script, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "chief.local", "--ps", "1", "--workers", "1", "--grace", "5",
        *extra, str(script),
    ]  # fmt: skip


def test_view_erases_its_table_before_other_output_and_redraws_it():
    screen = io.StringIO()
    view = StatusView(screen, lambda: DOC, lambda: {"chief": "running"}, interval=60, tty=True)
    view.refresh()
    table = status_table(DOC, {"chief": "running"})
    assert screen.getvalue() == "\n".join(table) and len(table) == 4
    out = EraseBeforeWrite(screen, view)
    out.write("[chief] hello\n")
    erase = "\r\x1b[K" + "\x1b[1A\r\x1b[K" * 3  # the cursor ends where the table began
    assert screen.getvalue() == "\n".join(table) + erase + "[chief] hello\n"
    view.refresh()  # not due yet, but the table is off screen: drawn again at once
    assert screen.getvalue().endswith("[chief] hello\n" + "\n".join(table))
    view.refresh()  # on screen and not due: nothing
    assert screen.getvalue().endswith("[chief] hello\n" + "\n".join(table))


def test_view_writes_one_line_per_interval_when_not_a_tty():
    now = [0.0]
    screen = io.StringIO()
    view = StatusView(screen, lambda: DOC, interval=5, tty=False, clock=lambda: now[0])
    for t in (0.0, 1.0, 4.9, 5.0, 6.0):
        now[0] = t
        view.refresh()
    assert (
        screen.getvalue().splitlines()
        == ["[local] status: ps:0 up 3 vars 2.0KiB 5 push/s | worker:0 running 4 closures 1 failed"]
        * 2
    )
    view.erase()  # nothing drawn: nothing erased
    assert "\x1b" not in screen.getvalue()


@pytest.mark.slow
def test_local_status_prints_lines_when_stdout_is_not_a_terminal(tmp_path):
    script = tmp_path / "ticks.py"
    script.write_text(TICK_SCRIPT)
    proc = subprocess.run(
        launcher_argv(script, "--status", "--status-interval", "0.5"),
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert [f"[chief] tick {i}" for i in range(TICKS)] == [
        line for line in proc.stdout.splitlines() if line.startswith("[chief] tick")
    ]
    status = [line for line in proc.stderr.splitlines() if line.startswith("[local] status:")]
    assert status, proc.stderr
    assert "ps:0 up" in status[-1] and "worker:0 ready" in status[-1], status
    assert "\x1b" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_local_status_table_is_redrawn_in_place_on_a_terminal(tmp_path):
    script = tmp_path / "ticks.py"
    script.write_text(TICK_SCRIPT)
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        launcher_argv(script, "--status", "--status-interval", "0.3"),
        env=child_env({"TERM": "xterm"}),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
    )
    os.close(terminal)
    output = b""
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(controller, 65536)
                except OSError:  # the other side closed: the launcher and its roles exited
                    break
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(30) == 0, output.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(controller)
    text = output.decode(errors="replace")
    # The table was drawn (header, both tasks, the chief) and erased in place...
    assert re.search(r"role\s+state\s+detail", text), text[-3000:]
    assert re.search(r"ps:0\s+up\s+0 vars", text) and re.search(r"worker:0\s+ready", text)
    assert re.search(r"chief\s+running", text)
    assert "\x1b[1A\r\x1b[K" in text
    # ...and never cut a role's line: every tick arrived whole, in order.
    ticks = re.findall(r"\[chief\] tick (\d+)\r\n", text)
    assert ticks == [str(i) for i in range(TICKS)], text[-3000:]


def test_local_rejects_a_non_positive_status_interval(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    proc = subprocess.run(
        launcher_argv(script, "--status", "--status-interval", "0"),
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "status interval 0.0 must be > 0" in proc.stderr
