"""The README's command blocks, run as a user would copy them, so the README cannot drift.

Every ```sh and ```python block in README.md is preceded by a marker: `<!-- test: sh -->` (run
from the repository root on CPU), `<!-- test: sh, output below -->` (run, and its output must
equal the ```text block after it), `<!-- test: sh-server -->` and `<!-- test: python-server -->`
(run against a server on the tiny model: 127.0.0.1:8080 becomes that server's address), or
`<!-- untested: why -->`. A block without a marker fails the test."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .conftest import ENV, ROOT

BLOCK = re.compile(
    r"(?:<!-- (?P<marker>[^>]*) -->\n)?```(?P<lang>sh|python|text)\n(?P<body>.*?)```", re.S
)


def blocks() -> list[dict]:
    found = [m.groupdict() for m in BLOCK.finditer((ROOT / "README.md").read_text())]
    out = []
    for i, b in enumerate(found):
        if b["lang"] == "text":
            continue
        b["output"] = None
        if b["marker"] and "output below" in b["marker"] and i + 1 < len(found):
            b["output"] = found[i + 1]["body"]
        out.append(b)
    return out


def test_every_command_block_says_whether_it_is_tested():
    unmarked = [b["body"][:60] for b in blocks() if not b["marker"]]
    assert not unmarked, unmarked
    assert all(b["marker"].startswith(("test:", "untested:")) for b in blocks())


def env() -> dict:
    bindir = str(Path(sys.executable).parent)  # mpinfer, torchrun: this environment's
    return {**ENV, "PATH": bindir + ":" + ENV.get("PATH", "")}


def test_readme_command_blocks_run_as_written_in_order():
    """As a user follows the README: each CPU block in turn (later ones use what earlier ones
    made), from the repository root."""
    cpu = [b for b in blocks() if b["marker"] in ("test: sh", "test: sh, output below")]
    assert len(cpu) >= 3
    for block in cpu:
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block["body"]], cwd=ROOT,
                              env=env(), capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, (block["body"], proc.stdout[-2000:], proc.stderr[-3000:])
        if block["output"] is not None:
            assert proc.stdout == block["output"], proc.stdout


def test_readme_server_examples_run_against_a_server(server):
    examples = [b for b in blocks() if b["marker"] in ("test: sh-server", "test: python-server")]
    assert {b["lang"] for b in examples} == {"sh", "python"}
    address = server.url.removeprefix("http://")
    for block in examples:
        body = block["body"].replace("127.0.0.1:8080", address)
        cmd = ["bash", "-e", "-o", "pipefail", "-c", body] if block["lang"] == "sh" else \
            [sys.executable, "-c", body]  # fmt: skip
        proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 0, (body, proc.stderr[-3000:])
        assert proc.stdout.strip() and '"error"' not in proc.stdout, proc.stdout
