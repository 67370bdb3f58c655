"""How a served job lives and dies, as real processes: a rank killed, SIGTERM and SIGINT to
`mpinfer serve` (drain, exit 0, no traceback; a second signal at once), the launcher killed
outright (no rank outlives it), and `mpinfer generate --nproc` staying quiet. Each test starts
its own server on the tiny model (127.0.0.1, a free port)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from .conftest import ENV, ROOT, Server


def test_sigkill_of_rank_1_ends_every_process_nonzero(ckpts):
    s = Server(ckpts["st_sharded"], "server.max_seq_len=256", launcher="torchrun")
    try:
        outcome = {}

        def stream():
            try:
                with httpx.stream(
                    "POST",
                    s.url + "/generate_stream",
                    timeout=60,
                    json={"inputs": "a", "parameters": {"max_new_tokens": 200}},
                ) as r:
                    outcome["events"] = [line for line in r.iter_lines() if line]
            except httpx.HTTPError as e:
                outcome["error"] = repr(e)

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        t0 = time.time()
        os.kill(s.rank_pid(1), signal.SIGKILL)
        code = s.proc.wait(timeout=90)
        assert code != 0
        assert time.time() - t0 < 60
        t.join(timeout=30)
        # The client saw the failure: an error event, or the connection ended without a final one.
        events = outcome.get("events", [])
        assert "error" in outcome or not events or 'generated_text": "' not in events[-1]
    finally:
        s.stop()


def test_mpinfer_serve_stops_cleanly_on_sigterm_and_at_once_on_a_second(ckpts):
    """The launcher a service manager runs: SIGTERM drains an in-flight request, every rank
    and the launcher exit 0, no traceback; a second signal during a drain ends everything at
    once with a non-zero status."""
    s = Server(ckpts["st_sharded"], "server.max_seq_len=300", "server.shutdown_timeout=30")
    try:
        result = {}
        body = {"inputs": "a", "parameters": {"max_new_tokens": 120, "details": True}}
        t = threading.Thread(target=lambda: result.update(
            r=httpx.post(s.url + "/generate", json=body, timeout=60)))  # fmt: skip
        t.start()
        while s.metric("mpinfer_running_slots") < 1:
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=60) == 0, s.output()[-3000:]
        t.join(timeout=30)
        assert result["r"].status_code == 200
        assert result["r"].json()["details"]["generated_tokens"] == 120
        assert "Traceback" not in s.output() and all(not p.is_running() for p in s.ranks)
    finally:
        s.stop()
    s = Server(ckpts["st_sharded"], "server.max_seq_len=300", "server.shutdown_timeout=30")
    try:
        body = {"inputs": "a", "parameters": {"max_new_tokens": 290}}

        def in_flight():
            with contextlib.suppress(httpx.HTTPError):  # the server goes away mid-request
                httpx.post(s.url + "/generate", json=body, timeout=60)

        t = threading.Thread(target=in_flight)
        t.start()
        while s.metric("mpinfer_running_slots") < 1:
            time.sleep(0.02)
        t0 = time.time()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=30) != 0
        assert time.time() - t0 < 10  # not the 30 s drain
        t.join(timeout=30)
    finally:
        s.stop()


def test_sigint_is_named_as_sigint_and_docs_are_off_offline(ckpts):
    """Ctrl-C's signal sent to `mpinfer serve` drains as SIGTERM does, and the log names it;
    /info's version is the installed package's; /docs (CDN scripts) is off unless asked."""
    from importlib.metadata import version

    s = Server(ckpts["st_sharded"], "server.max_seq_len=300")
    try:
        assert httpx.get(s.url + "/info").json()["version"] == version("mpinfer")
        assert httpx.get(s.url + "/docs").status_code == 404
        assert httpx.get(s.url + "/openapi.json").status_code == 200
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=60) == 0, s.output()[-3000:]
        assert "SIGINT: draining" in s.output() and "SIGTERM" not in s.output()
    finally:
        s.stop()


@pytest.mark.parametrize("launcher", ["mpinfer", "torchrun"])
def test_no_rank_outlives_its_launcher_killed_outright(ckpts, launcher):
    """SIGKILL of the launcher: it can forward nothing, and its ranks run in sessions of their
    own; each rank notices its parent is gone and exits within seconds."""
    s = Server(ckpts["st_sharded"], nproc=2, launcher=launcher)
    try:
        ranks = s.ranks
        assert len(ranks) == 2
        os.kill(s.proc.pid, signal.SIGKILL)
        deadline = time.time() + 10
        while (
            any(p.is_running() and p.status() != "zombie" for p in ranks) and time.time() < deadline
        ):
            time.sleep(0.1)
        assert not any(p.is_running() and p.status() != "zombie" for p in ranks)
    finally:
        s.stop()


def test_mpinfer_generate_nproc_is_quiet_and_says_so(ckpts):
    """No OMP_NUM_THREADS banner from torch, no traceback: the thread count is set and said."""
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mpinfer.cli",
            "generate",
            "--nproc",
            "2",
            "--model",
            str(ckpts["st_sharded"]),
            "--max-new-tokens",
            "4",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Setting OMP_NUM_THREADS" not in proc.stderr and "Traceback" not in proc.stderr
    assert "OMP_NUM_THREADS=" in proc.stderr


def test_ctrl_c_during_generate_keeps_the_text_so_far_and_exits_130(ckpts):
    """Ctrl-C in the terminal of `mpinfer generate --nproc 2` (the pty's interrupt character:
    SIGINT to the launcher, which passes it on): the requests end where they are, rank 0 prints
    the text so far and one line saying it stopped, exit 130, no traceback from any rank."""
    import pexpect

    child = pexpect.spawn(
        sys.executable,
        [
            "-m",
            "mpinfer.cli",
            "generate",
            "--nproc",
            "2",
            "--model",
            str(ckpts["st_sharded"]),
            "--prompt",
            "Once upon a time",
            "--max-new-tokens",
            "480",
            "--greedy",
        ],  # fmt: skip
        cwd=str(ROOT),
        env=ENV,
        encoding="utf-8",
        timeout=120,
    )
    try:
        child.expect("loaded in")  # the ranks are generating
        time.sleep(0.3)
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    out = child.before
    assert child.exitstatus == 130, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    stopped = [line for line in out.splitlines() if "SIGINT: stopped after" in line]
    assert len(stopped) == 1, out[-3000:]
    tokens = int(stopped[0].split("after ")[1].split()[0])
    assert 0 < tokens < 480 and "Once upon a time" in out, out[-3000:]


def spawn_in_a_pty(*argv: str):
    import pexpect

    return pexpect.spawn(sys.executable, ["-m", "mpinfer.cli", *argv], cwd=str(ROOT), env=ENV,
                         encoding="utf-8", timeout=120, dimensions=(40, 200))  # fmt: skip


@pytest.mark.parametrize("when", ["loading", "serving"])
def test_ctrl_c_in_the_terminal_of_serve(ckpts, when):
    """The pty's interrupt character to `mpinfer serve --nproc 2`: while the model loads every
    rank stops with one line and exit 130; once serving, the server drains and exits 0 (it was
    stopped on purpose); never a traceback from any rank."""
    import pexpect

    child = spawn_in_a_pty("serve", "--nproc", "2", "--model", str(ckpts["st_sharded"]),
                           "--set", "server.port=0")  # fmt: skip
    try:
        child.expect(r"listening on http://127\.0\.0\.1:(\d+) \(loading\)")
        assert int(child.match.group(1)) > 0  # the port the OS picked, not 0
        if when == "serving":
            child.expect("ready: http://")
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    out = child.before
    assert "Traceback" not in out, out[-3000:]
    if when == "loading":
        assert child.exitstatus == 130, out[-3000:]
        assert out.count("SIGINT: stopped while loading, before serving") == 1, out[-3000:]
        assert "ready:" not in out
    else:
        assert child.exitstatus == 0, out[-3000:]
        assert "SIGINT: draining" in out and "stopped" in out, out[-3000:]


def test_ctrl_c_in_the_terminal_of_the_repl(ckpts):
    """`mpinfer repl --nproc 2`: Ctrl-C mid-answer keeps the text so far and returns to the
    prompt with every rank alive (the next answer streams), Ctrl-C at an empty prompt leaves
    (exit 0, as Ctrl-D does); no traceback."""
    import pexpect

    child = spawn_in_a_pty("repl", "--nproc", "2", "--model", str(ckpts["st_sharded"]),
                           "--set", "generation.max_new_tokens=480")  # fmt: skip
    try:
        child.expect(">>> ")
        child.sendline("river")
        child.expect(r"\S{3}")  # the answer is streaming
        time.sleep(0.3)
        child.sendintr()
        child.expect(r"\[stopped\]")
        partial = child.before
        child.expect(">>> ")
        child.sendline("/set max_new_tokens=4")
        child.expect(">>> ")
        child.sendline("river")
        child.expect(r"\[4 tokens · first token")  # both ranks took the next request
        child.expect(">>> ")
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert len(partial.split("river", 1)[-1].strip()) >= 3, partial
    assert child.exitstatus == 0, child.before[-3000:]
    assert "Traceback" not in partial + child.before
