"""The REPL in a real pseudo-terminal under torchrun (tp=2), piped, and attached to a server."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pexpect
import pytest

from mpinfer.dist import torchrun_command

from .conftest import ENV, ROOT, Server, torchrun

PROMPT = "the capital of france is"


@pytest.fixture(scope="module")
def reference(ckpts):
    out = {}
    for n in (8, 3):
        proc = torchrun(
            2,
            [
                "launch/generate.py",
                "--model",
                str(ckpts["st_sharded"]),
                "--greedy",
                "--json",
                "--max-new-tokens",
                str(n),
                "--prompt",
                PROMPT,
            ],
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[n] = json.loads(proc.stdout.splitlines()[-1])["text"]
    return out


def spawn(args: list[str], tmp_path) -> pexpect.spawn:
    env = {**ENV, "MPINFER_LOG_LEVEL": "WARNING"}
    cmd = torchrun_command(
        2,
        [
            "launch/repl.py",
            *args,
            "--history",
            str(tmp_path / "hist"),
        ],
    )
    return pexpect.spawn(
        cmd[0], cmd[1:], cwd=str(ROOT), env=env, encoding="utf-8", timeout=90, dimensions=(40, 200)
    )


def answer(child: pexpect.spawn) -> str:
    """The streamed text between the echoed prompt line and the statistics line."""
    child.expect(r"\[(\d+) tokens · first token .*\]")
    text = child.before.split("\r\n", 1)[1] if "\r\n" in child.before else child.before
    return text.rstrip("\r\n").replace("\r\n", "\n")


def test_repl_in_a_pty(ckpts, reference, tmp_path):
    child = spawn(
        ["--model", str(ckpts["st_sharded"]), "--set", "generation.max_new_tokens=8"], tmp_path
    )
    child.expect(">>> ")
    child.sendline(PROMPT)
    assert answer(child) == reference[8]  # streamed greedy answer = launch/generate.py's
    child.expect(">>> ")
    child.sendline("/set max_new_tokens=3")
    child.expect("max_new_tokens=3")
    child.expect(">>> ")
    child.sendline(PROMPT)
    assert answer(child) == reference[3]  # /set changed the next answer
    child.expect(">>> ")
    child.sendline("/set top_p=7")
    child.expect(re.escape("error: top_p=7.0 must be in (0, 1]"))  # a bad /set keeps the session
    child.expect(">>> ")
    # Ctrl-C mid-answer: back at the prompt, and both ranks still work.
    child.sendline("/set max_new_tokens=1500")
    child.expect(">>> ")
    child.sendline("river")
    child.expect(r"\S{3}")  # some answer text has streamed
    child.sendcontrol("c")
    child.expect(re.escape("[stopped]"))
    child.expect(">>> ")
    child.sendline("/reset")
    child.expect(">>> ")
    child.sendline(PROMPT)
    assert answer(child) == reference[8]
    child.expect(">>> ")
    child.sendline("a multi-line \\")
    child.expect(r"\.\.\. ")
    child.sendline("prompt")
    child.expect("tokens/s")
    child.expect(">>> ")
    child.sendeof()  # Ctrl-D: every rank exits 0
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    assert (tmp_path / "hist").read_text().count(PROMPT) >= 2  # history was saved


def test_ctrl_c_at_empty_prompt_exits_cleanly(ckpts, tmp_path):
    child = spawn(["--model", str(ckpts["st_sharded"])], tmp_path)
    child.expect(">>> ")
    child.sendcontrol("c")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_piped_stdin_one_prompt_per_line(ckpts, reference):
    proc = subprocess.run(
        torchrun_command(
            2,
            [
                "launch/repl.py",
                "--model",
                str(ckpts["st_sharded"]),
                "--set",
                "generation.max_new_tokens=8",
            ],
        ),
        input=f"{PROMPT}\n{PROMPT}\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=ENV,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [reference[8], reference[8]]
    assert proc.stderr.count("tokens/s") == 2


def test_url_attaches_to_a_running_server_and_takes_its_defaults(ckpts, reference):
    """`mpinfer repl --url`: the server's generation defaults (its max_new_tokens, 3 here),
    then the command line's --set generation.* on top."""
    server = Server(ckpts["st_sharded"], "generation.max_new_tokens=3")
    try:
        outs = []
        for extra in ([], ["--set", "generation.max_new_tokens=8"]):
            proc = subprocess.run(
                [sys.executable, "-m", "mpinfer.cli", "repl", "--url", server.url, *extra],
                input=f"{PROMPT}\n", capture_output=True, text=True, cwd=ROOT, timeout=60,
                env=ENV,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            outs.append(proc.stdout.splitlines())
    finally:
        server.stop()
    assert outs == [[reference[3]], [reference[8]]]
