"""The documentation: links that resolve, examples that run, and a list of gaps that stays true.

* every relative link of README.md, docker/README.md and docs/*.md names a
  file of the repository (and, with ``#anchor``, one of its headings);
* the Python examples of docs/dynamic_embedding.md and
  docs/mirrored_cpu_replicas.md run as written (real processes);
* every TensorFlow name docs/not_implemented.md lists is still absent from
  psflow: implementing one fails this test until its row goes.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

import psflow
from tests.conftest import ROOT, child_env

DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "docker" / "README.md", *DOCS]
# Linked from README's Reference ahead of its page, which another change of issue 29 adds.
PENDING = {ROOT / "docs" / "checkpoints.md"}
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def links(text: str) -> list[str]:
    """The targets of the Markdown links and images in ``text`` (code spans and blocks left out)."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return [a or b for a, b in _LINK.findall(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    heading = re.sub(r"`", "", heading.strip().lower())
    heading = re.sub(r"[^\w\- ]", "", heading)
    return heading.replace(" ", "-")


def anchors(path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_an_existing_file(page):
    broken = []
    for target in links(page.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if path in PENDING:
            continue
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading #{anchor} in {path.name}")
    assert broken == [], f"{page.relative_to(ROOT)}: {broken}"


def test_the_link_check_catches_a_broken_link(tmp_path):
    assert links("[a](x.md) ![b](img.png) `[c](code.md)` [d](https://e.org)") == [
        "x.md",
        "img.png",
        "https://e.org",
    ]
    assert slug("Your own script") == "your-own-script"
    assert slug("`psflow.keras.layers.DynamicEmbedding`") == "psflowkeraslayersdynamicembedding"


def test_readme_reference_links_the_docs_pages():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Reference", 1)[1].split("\n## ", 1)[0]
    for page in [*DOCS, *PENDING]:
        if page.suffix == ".md":
            assert f"(docs/{page.name})" in section, page.name


def python_blocks(path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize(
    "page, expected",
    [
        ("dynamic_embedding.md", "restored the checkpointed rows"),
        ("mirrored_cpu_replicas.md", ""),
    ],
)
def test_docs_examples_run_as_written(tmp_path, page, expected):
    code = python_blocks(ROOT / "docs" / page)[-1 if page == "dynamic_embedding.md" else 0]
    script = tmp_path / "example.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env({"PSFLOW_NUM_CPU_DEVICES": "1"}),
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert expected in out.stdout


def psflow_has(name: str) -> bool:
    """Whether ``tf.a.b.C`` resolves in psflow (attributes, else submodules)."""
    obj = psflow
    for part in name.split(".")[1:]:
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        module = getattr(obj, "__name__", None) if isinstance(obj, type(psflow)) else None
        try:
            obj = importlib.import_module(f"{module}.{part}") if module else None
        except ImportError:
            obj = None
        if obj is None:
            return False
    return True


def listed_missing() -> list[str]:
    text = (ROOT / "docs" / "not_implemented.md").read_text()
    return re.findall(r"^\| `(tf\.[\w.]+)` \|", text, flags=re.M)


def test_not_implemented_lists_only_what_psflow_lacks():
    names = listed_missing()
    assert len(names) > 150 and len(set(names)) == len(names)
    present = [n for n in names if psflow_has(n)]
    assert present == [], f"implemented now: remove from docs/not_implemented.md: {present}"
    # The check itself sees what psflow has, under the same spelling.
    for name in (
        "tf.distribute.ParameterServerStrategy",
        "tf.distribute.experimental.coordinator.ClusterCoordinator",
        "tf.keras.layers.DynamicEmbedding",
        "tf.data.Dataset.padded_batch",
        "tf.train.CheckpointManager",
    ):
        assert psflow_has(name), name
