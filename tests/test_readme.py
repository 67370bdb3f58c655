"""The README's command blocks, run as a user would copy them, so the README cannot drift.

Every ```sh and ```python block in README.md is preceded by a marker: `<!-- test: sh -->` (run
from the repository root on CPU), `<!-- test: sh, output below -->` (run, and its output must
equal the ```text block after it), `<!-- test: sh-server -->` and `<!-- test: python-server -->`
(run against a server on the tiny model: 127.0.0.1:8080 becomes that server's address),
`<!-- test: fresh-shell -->` (the Quick start: in a shell with no virtual environment active),
`<!-- test: client-venv -->` (the client install, in a new venv of its own, where the Python
example then runs), or `<!-- untested: why -->`. A block without a marker fails the test."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mpinfer.startup.launcher import free_port

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


def marked(marker: str) -> dict:
    (block,) = [b for b in blocks() if b["marker"] == marker]
    return block


def fresh_shell_env() -> dict:
    """A new shell's environment: no virtual environment active, no mpinfer or torchrun on the
    PATH (so the Quick start's activation line is what makes them work)."""
    env = {
        k: v for k, v in ENV.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "OMP_NUM_THREADS")
    }
    dirs = [d for d in env.get("PATH", "").split(":") if d]
    env["PATH"] = ":".join(d for d in dirs if not any(
        (Path(d) / tool).exists() for tool in ("mpinfer", "torchrun")))  # fmt: skip
    return env


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_quick_start_runs_in_a_fresh_shell():
    """Every line of the Quick start, as a new user types them into a new shell: `make demo`,
    the activation, an `mpinfer` command; then `make serve` answers and Ctrl-C (SIGINT to its
    process group, as a terminal sends it) stops it quietly. `make test` is the suite that runs
    this test, so it is the one line not run here."""
    lines = [
        line.split("#")[0].strip() for line in marked("test: fresh-shell")["body"].splitlines()
    ]
    lines = [line for line in lines if line]
    assert lines[-1] == "make test" and "make serve" in lines, lines
    env = fresh_shell_env()
    assert subprocess.run(["bash", "-c", "command -v mpinfer"], env=env,
                          capture_output=True).returncode != 0  # fmt: skip
    script = [line for line in lines if line not in ("make serve", "make test")]
    proc = subprocess.run(["bash", "-e", "-c", "\n".join(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, (script, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "command not found" not in proc.stderr

    port = 8080 if port_is_free(8080) else free_port(below_ephemeral=True)
    cmd = "make serve" if port == 8080 else f"make serve ARGS='--port {port}'"
    serve = subprocess.Popen(["bash", "-c", cmd], cwd=ROOT, env=env, text=True,
                             start_new_session=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)  # fmt: skip
    try:
        url, deadline, status = f"http://127.0.0.1:{port}", time.time() + 180, None
        while time.time() < deadline and serve.poll() is None and status != 200:
            try:
                status = httpx.get(url + "/health", timeout=2).status_code
            except httpx.HTTPError:
                time.sleep(0.3)
        assert status == 200, serve.poll()
        body = {"inputs": "Hello", "parameters": {"max_new_tokens": 4}}
        assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
        os.killpg(serve.pid, signal.SIGINT)
        out, _ = serve.communicate(timeout=60)
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
    assert "SIGINT: draining" in out and "Traceback" not in out, out[-3000:]


def test_readme_client_example_runs_with_its_pinned_clients(server, tmp_path):
    """The README's client install line in a new venv of its own, then its Python example with
    that venv's interpreter: the pinned versions work together and against the server."""
    venv = tmp_path / "clients"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {**ENV, "VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:" + ENV.get("PATH", "")}
    install = marked("test: client-venv")["body"]
    proc = subprocess.run(["bash", "-e", "-c", install], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    example = marked("test: python-server")["body"]
    example = example.replace("127.0.0.1:8080", server.url.removeprefix("http://"))
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", example], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[1].startswith("[None, "), proc.stdout


TEST_REF = re.compile(r"`(\w+\.py)::(\w+?)(\.\.\.)?`")


def test_the_tests_the_docs_name_exist():
    """README.md and docs/*.md name tests as `file.py::name` (or `file.py::prefix...`): each
    must be a test or fixture of that file, so a moved or renamed test cannot leave a promise
    pointing nowhere."""
    missing, seen = [], 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for file, name, prefix in TEST_REF.findall(doc.read_text()):
            seen += 1
            defs = re.findall(r"^def (\w+)", (ROOT / "tests" / file).read_text(), re.M)
            if not any(d.startswith(name) if prefix else d == name for d in defs):
                missing.append(f"{doc.name}: {file}::{name}{prefix}")
    assert seen >= 10 and not missing, missing


def test_the_count_of_hostile_bodies_is_the_tests():
    from .test_server import BAD

    text = (ROOT / "docs" / "reliability.md").read_text()
    (said,) = re.findall(r"\((\d+) hostile bodies\)", text)
    assert int(said) == len(BAD)


def test_the_readme_stays_a_readme():
    """README.md is for users: at most 350 lines (detail goes in docs/), and it says what the KV
    cache is now (blocks), not what it was (static slots)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 350
    assert "static KV cache" not in text and "KV cache in blocks" in text
