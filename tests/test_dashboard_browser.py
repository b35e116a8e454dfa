"""The real dashboard page in headless Chromium, during a real ``psflow local`` run.

Starts 2 PS + 2 workers + the chief (training the digits model) with
``--dashboard``, reads the page's DOM after its scripts ran
(``chromium --headless --dump-dom``), kills a worker, reads it again and saves a
screenshot under the test's ``tmp_path``.  Skipped when no Chromium binary is
installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import contextlib
import html.parser
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import jsonschema
import pytest

from tests.conftest import ROOT, child_env, pick_free_port

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium_binary() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class _Elements(html.parser.HTMLParser):
    """Every start tag of a document with its attributes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))


def page_facts(dom: str) -> dict:
    """Rows by task (their data-state), the loss chart's attributes, event kinds shown."""
    parser = _Elements()
    parser.feed(dom)
    rows = {
        a["data-task"]: a["data-state"]
        for t, a in parser.elements
        if t == "tr" and "data-task" in a
    }
    svgs = {a.get("id"): a for t, a in parser.elements if t == "svg"}
    events = [a["data-kind"] for t, a in parser.elements if t == "li" and "data-kind" in a]
    status = next((a for t, a in parser.elements if a.get("id") == "status"), {})
    job = next((a for t, a in parser.elements if a.get("id") == "job"), {})
    signals, row = {}, None
    for t, a in parser.elements:
        if t == "tr" and "data-task" in a:
            row = a["data-task"]
        elif t == "td" and "data-signal" in a and row is not None:
            signals[row] = a["data-signal"]
    return {
        "rows": rows,
        "loss": svgs.get("loss-svg", {}),
        "events": events,
        "status": status,
        "job": job,
        "signal": signals,
    }


def render(
    chromium: str, url: str, profile: pathlib.Path, screenshot: pathlib.Path | None = None
) -> str:
    """The DOM after the page's scripts ran for a few (virtual) seconds; optionally a PNG too."""
    argv = [
        chromium,
        "--headless",
        "--no-sandbox",  # tests may run as root in containers
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=1280,1150",
        "--virtual-time-budget=3000",
    ]
    if screenshot is not None:
        argv.append(f"--screenshot={screenshot}")
    argv += ["--dump-dom", url]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=profile)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


SCHEMA = json.loads(
    (pathlib.Path(__file__).parent / "schemas" / "cluster_api.schema.json").read_text()
)


def api(url: str) -> dict:
    """The live document, checked against its schema."""
    with urllib.request.urlopen(url + "api/cluster", timeout=10) as reply:
        doc = json.load(reply)
    jsonschema.validate(doc, SCHEMA, cls=jsonschema.Draft202012Validator)
    return doc


def wait_api(
    url: str, predicate, timeout: float, launcher: subprocess.Popen, log: pathlib.Path
) -> dict:
    deadline = time.monotonic() + timeout
    doc: dict = {}
    while time.monotonic() < deadline:
        assert launcher.poll() is None, f"psflow local exited early:\n{log.read_text()[-4000:]}"
        with contextlib.suppress(OSError, ValueError):
            doc = api(url)
            if predicate(doc):
                return doc
        time.sleep(0.2)
    raise AssertionError(
        f"not reached within {timeout}s; last document {str(doc)[:2000]}\n{log.read_text()[-4000:]}"
    )


def workers(doc: dict) -> dict[str, dict]:
    return {w["task"]: w for w in doc["workers"]}


@pytest.mark.slow
def test_page_shows_ps_tasks_lost_worker_and_live_loss(tmp_path):
    chromium = chromium_binary()
    if chromium is None:
        pytest.skip(
            f"no Chromium binary found (looked for {', '.join(CHROMIUM_NAMES)}); "
            "install Debian's `chromium` package to run the browser test"
        )
    port = pick_free_port()
    url = f"http://127.0.0.1:{port}/"
    log = tmp_path / "local.log"
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    argv = [
        sys.executable,
        "-m",
        "chief.local",
        "--ps",
        "2",
        "--workers",
        "2",
        "--grace",
        "5",
        "--dashboard",
        str(port),
        str(ROOT / "examples" / "digits_ps.py"),
        "--epochs",
        "1000",
    ]
    with open(log, "w") as out:
        launcher = subprocess.Popen(
            argv,
            env=child_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
    try:
        wait_api(
            url,
            lambda d: (
                d["training"]["global_step"] >= 20
                and all(w["state"] == "running" for w in d["workers"])
            ),
            120,
            launcher,
            log,
        )
        before = page_facts(render(chromium, url, profile))
        assert before["status"].get("data-state") == "live", before
        assert set(before["rows"]) == {"ps:0", "ps:1", "worker:0", "worker:1"}, before["rows"]
        first_step = int(before["loss"]["data-last-step"])
        assert first_step >= 20 and int(before["loss"]["data-points"]) >= 20

        victim = workers(api(url))["worker:1"]["pid"]
        os.kill(victim, signal.SIGKILL)
        # psflow local saw it die: killed, with its signal (a probe alone would say lost).
        wait_api(url, lambda d: workers(d)["worker:1"]["state"] == "killed", 60, launcher, log)
        shot = tmp_path / "dashboard.png"
        after = page_facts(render(chromium, url, profile, screenshot=shot))

        assert after["rows"]["ps:0"] == after["rows"]["ps:1"] == "up", after["rows"]
        assert after["rows"]["worker:1"] == "killed", after["rows"]
        assert after["signal"].get("worker:1") == "SIGKILL", after
        assert after["job"].get("hidden") is None, after  # the --restart on-failure hint shows
        assert after["rows"]["worker:0"] in ("running", "ready"), after["rows"]
        assert "task_exited" in after["events"], after["events"]
        assert int(after["loss"]["data-last-step"]) > first_step, (before["loss"], after["loss"])
        assert shot.stat().st_size > 10_000  # a rendered page, not a blank one
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)  # the launcher stops and reaps every role
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
