"""The interactive REPL: rank 0 reads the terminal, every rank computes (or, with --url, a
client of a running mpinfer server, with no model loaded).

    >>> The capital of France is
     Paris ...
    [12 tokens · first token 41 ms · 88.2 tokens/s]

Line editing and history through readline (history kept in ~/.mpinfer_history); a line ending
in a backslash continues on the next (`... `). Commands: /help, /set key=value, /show, /reset,
/quit. Ctrl-C during an answer stops it on every rank and returns to the prompt; Ctrl-C or
Ctrl-D at an empty prompt exits, every rank with 0. Piped stdin: one prompt per line, answers on
stdout, one per line, statistics on stderr.

Why Ctrl-C works under torchrun: torchrun starts every rank in a session of its own, so the
terminal's SIGINT reaches torchrun alone, which answers it by shutting the whole job down. So
the REPL turns the terminal's interrupt character off and reads Ctrl-C as a key: at the prompt
through a readline binding, during an answer by polling the terminal. Other ranks ignore
SIGINT: they stop when rank 0's engine says so.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import queue
import readline
import select
import signal
import sys
import termios
import threading
import time
from pathlib import Path

import httpx

from .config import add_config_args, load_config
from .engine.sampling import SamplingParams
from .startup.launcher import add_launch_args
from .startup.runtime import default_params, rank_config, run_rank, start

HELP = """commands:
  /set key=value   temperature, top_k, top_p, typical_p, repetition_penalty, max_new_tokens,
                   seed, stop (text; several separated by |), greedy (true/false)
  /show            the current settings
  /reset           back to the config's settings
  /quit            leave (or Ctrl-D; Ctrl-C at an empty prompt)
a line ending in \\ continues on the next line; Ctrl-C stops an answer"""

FIELDS = {"temperature": float, "top_k": int, "top_p": float, "typical_p": float,
          "repetition_penalty": float, "max_new_tokens": int, "seed": int}  # fmt: skip


def apply_set(params: SamplingParams, arg: str) -> SamplingParams:
    """`/set key=value` on params; a ValueError naming the key when it is not valid."""
    if "=" not in arg:
        raise ValueError(f"/set {arg!r}: expected key=value (see /help)")
    key, value = (s.strip() for s in arg.split("=", 1))
    if key == "greedy":
        if value.lower() not in ("true", "false", "1", "0", "on", "off"):
            raise ValueError(f"greedy={value!r}: expected true or false")
        return dataclasses.replace(params, do_sample=value.lower() in ("false", "0", "off"))
    if key == "stop":
        stops = tuple(s for s in value.split("|") if s) if value else ()
        return dataclasses.replace(params, stop=stops).check()
    if key not in FIELDS:
        raise ValueError(
            f"unknown setting {key!r}; one of: {', '.join([*FIELDS, 'stop', 'greedy'])}"
        )
    try:
        parsed = FIELDS[key](value)
    except ValueError:
        raise ValueError(f"{key}={value!r}: expected {FIELDS[key].__name__}") from None
    new = dataclasses.replace(params, **{key: parsed})
    if key in ("temperature", "top_k", "top_p", "typical_p") and not params.do_sample:
        new = dataclasses.replace(new, do_sample=True)  # asking for them means sampling
    return new.check()


SHOWN = ("max_new_tokens", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
         "seed", "stop")  # fmt: skip


def show(params: SamplingParams) -> str:
    d = {k: getattr(params, k) for k in SHOWN}
    d["greedy"] = not params.do_sample
    if d["seed"] is None:
        d["seed"] = "random"
    return "  ".join(f"{k}={v!r}" if k == "stop" else f"{k}={v}" for k, v in d.items())


class Terminal:
    """Rank 0's terminal: Ctrl-C as a key (not a signal), readline history, prompts."""

    def __init__(self, history: str):
        self.tty = sys.stdin.isatty()
        self.history = Path(history).expanduser()
        self.saved = None
        if self.tty:
            with contextlib.suppress(OSError):
                readline.read_history_file(self.history)
            readline.set_history_length(1000)
            fd = sys.stdin.fileno()
            self.saved = termios.tcgetattr(fd)
            mode = [list(a) if isinstance(a, list) else a for a in self.saved]
            mode[6][termios.VINTR] = b"\x00"  # Ctrl-C is a plain key now: no SIGINT
            termios.tcsetattr(fd, termios.TCSADRAIN, mode)
            self.prompt_mode = mode
            # At the prompt, Ctrl-C appends a visible ^C and submits the line: read() sees it.
            readline.parse_and_bind(r'"\C-c": "\C-e^C\C-j"')

    def close(self) -> None:
        if self.saved is not None:
            with contextlib.suppress(OSError):
                readline.write_history_file(self.history)
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, self.saved)

    def read(self) -> str | None:
        """One (possibly multi-line) input; None at end of input. Ctrl-C on an empty prompt
        raises KeyboardInterrupt; on a line being typed, it drops the line."""
        lines, prompt = [], ">>> "
        while True:
            try:
                line = input(prompt) if self.tty else sys.stdin.readline()
            except EOFError:
                return None
            if not self.tty:
                if line == "":
                    return None
                line = line.rstrip("\n")
            elif line.endswith("^C"):
                n = readline.get_current_history_length()
                if n:
                    readline.remove_history_item(n - 1)
                if not lines and line == "^C":
                    raise KeyboardInterrupt
                lines, prompt = [], ">>> "
                continue
            if line.endswith("\\"):
                lines.append(line[:-1])
                prompt = "... "
                continue
            lines.append(line)
            return "\n".join(lines)

    @contextlib.contextmanager
    def answering(self):
        """While an answer streams: keys unbuffered and not echoed, so Ctrl-C can be seen."""
        if not self.tty:
            yield
            return
        fd = sys.stdin.fileno()
        mode = [list(a) if isinstance(a, list) else a for a in self.prompt_mode]
        mode[3] &= ~(termios.ICANON | termios.ECHO)
        mode[6][termios.VMIN], mode[6][termios.VTIME] = 0, 0
        termios.tcsetattr(fd, termios.TCSADRAIN, mode)
        try:
            yield
        finally:
            termios.tcsetattr(fd, termios.TCSADRAIN, self.prompt_mode)

    def interrupted(self) -> bool:
        """Whether Ctrl-C was pressed since the last look (other keys are dropped)."""
        if not self.tty:
            return False
        fd = sys.stdin.fileno()
        hit = False
        while select.select([fd], [], [], 0)[0]:
            data = os.read(fd, 1024)
            if not data:
                break
            hit = hit or b"\x03" in data
        return hit


class EngineBackend:
    """Generation through this job's engine (rank 0 side)."""

    def __init__(self, engine, tokenizer):
        self.engine, self.tok = engine, tokenizer

    def stream(self, prompt: str, params: SamplingParams, on_text, interrupted) -> dict:
        ids = self.tok.encode(prompt, add_special_tokens=False).ids
        events: queue.Queue = queue.Queue()
        req = self.engine.submit(ids, params, events.put)
        try:
            while True:
                try:
                    ev = events.get(timeout=0.05)
                except queue.Empty:
                    ev = None
                if interrupted():  # a non-blocking look at the terminal: cheap every event
                    raise KeyboardInterrupt
                if ev is None:
                    continue
                if ev.kind == "error":
                    raise RuntimeError(ev.error)
                if ev.text:
                    on_text(ev.text)
                if ev.kind == "done":
                    r = ev.result
                    return {"tokens": len(r.token_ids), "ttft": r.ttft_s, "total": r.latency_s,
                            "finish": r.finish_reason}  # fmt: skip
        except KeyboardInterrupt:
            self.engine.cancel(req)
            while (ev := events.get()).kind not in ("done", "error"):
                pass  # drain until the engine confirms: its slot is free for the next prompt
            raise


class HttpBackend:
    """Generation through a running mpinfer server's /generate_stream."""

    def __init__(self, url: str, api_key: str = ""):
        self.url = url.rstrip("/")
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def defaults(self, overrides: list[str]) -> SamplingParams:
        """The server's [generation] defaults (from /info), then this command line's
        `--set generation.*` on top: the same defaults as the server's own routes."""
        try:
            r = httpx.get(self.url + "/info", headers=self.headers, timeout=30)
            served = r.json().get("generation_defaults", {}) if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as e:
            raise ValueError(f"--url {self.url}: no answer from /info ({e})") from None
        mine = [o for o in overrides if o.startswith("generation.")]
        cfg = load_config(None, [f"generation.{k}={json.dumps(v)}" for k, v in served.items()]
                          + mine)  # fmt: skip
        return default_params(cfg)

    def stream(self, prompt: str, params: SamplingParams, on_text, interrupted) -> dict:
        body = {"inputs": prompt, "parameters": {
            "max_new_tokens": params.max_new_tokens, "do_sample": params.do_sample,
            "temperature": params.temperature if params.do_sample else None,
            "top_k": params.top_k or None, "top_p": params.top_p if params.top_p < 1 else None,
            "typical_p": params.typical_p if params.typical_p < 1 else None,
            "repetition_penalty": params.repetition_penalty, "seed": params.seed,
            "stop": list(params.stop)}}  # fmt: skip
        t0, ttft, n, finish = time.perf_counter(), 0.0, 0, ""
        with httpx.stream("POST", self.url + "/generate_stream", json=body, headers=self.headers,
                          timeout=None) as r:  # fmt: skip
            if r.status_code != 200:
                r.read()
                raise ValueError(f"server answered {r.status_code}: {r.text}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                ev = json.loads(line[5:])
                if "error" in ev:
                    raise RuntimeError(ev["error"])
                n += 1
                ttft = ttft or time.perf_counter() - t0
                on_text(ev["token"]["text"])
                if ev.get("details"):
                    finish = ev["details"]["finish_reason"]
                if interrupted():  # leaving closes the stream: the server cancels it
                    raise KeyboardInterrupt
        return {"tokens": n, "ttft": ttft, "total": time.perf_counter() - t0, "finish": finish}


def run_repl(backend, defaults: SamplingParams, term: Terminal) -> int:
    params = defaults
    out = sys.stdout
    if term.tty:
        print("mpinfer REPL: /help for commands, Ctrl-D to leave", flush=True)
    while True:
        try:
            text = term.read()
        except KeyboardInterrupt:
            print()
            return 0
        if text is None:
            if term.tty:
                print()
            return 0
        if not text.strip():
            continue
        if text.startswith("/"):
            cmd, _, arg = text[1:].partition(" ")
            try:
                if cmd in ("quit", "exit", "q"):
                    return 0
                if cmd == "help":
                    print(HELP)
                elif cmd == "show":
                    print(show(params))
                elif cmd == "reset":
                    params = defaults
                    print(show(params))
                elif cmd == "set":
                    params = apply_set(params, arg)
                    print(show(params))
                else:
                    print(f"unknown command /{cmd} (see /help)")
            except ValueError as e:
                print(f"error: {e}")
            sys.stdout.flush()
            continue
        try:
            with term.answering():
                stats = backend.stream(text, params, lambda s: (out.write(s), out.flush()),
                                       term.interrupted)  # fmt: skip
        except KeyboardInterrupt:
            print("\n[stopped]", flush=True)
            continue
        except ValueError as e:
            print(f"\nerror: {e}", flush=True)
            continue
        rate = stats["tokens"] / max(stats["total"] - stats["ttft"], 1e-9)
        line = (f"[{stats['tokens']} tokens · first token {stats['ttft'] * 1e3:.0f} ms · "
                f"{rate:.1f} tokens/s · {stats['finish']}]")  # fmt: skip
        print(flush=True)
        print(line, file=sys.stdout if term.tty else sys.stderr, flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpinfer repl", description="interactive generation",
        epilog="examples:\n  mpinfer repl --nproc 2 --config configs/tiny-cpu.toml\n"
        "  mpinfer repl --url http://127.0.0.1:8080   (a running server: its generation "
        "defaults, --set generation.* on top)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    add_config_args(p)
    add_launch_args(p)
    p.add_argument("--url", help="attach to a running mpinfer server instead of loading a model")
    p.add_argument("--api-key", default="", help="bearer token for --url")
    p.add_argument("--history", default="~/.mpinfer_history", help="readline history file")
    return p


def repl_main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.url:
        backend = HttpBackend(args.url, args.api_key)
        try:
            defaults = backend.defaults(args.overrides)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        term = Terminal(args.history)
        try:
            return run_repl(backend, defaults, term)
        finally:
            term.close()
    cfg = rank_config(args)
    if cfg is None:
        return 2
    return run_rank(lambda ctx: _repl_rank(cfg, args, ctx), cfg)


def _repl_rank(cfg, args, ctx) -> None:
    if not ctx.is_rank0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 owns Ctrl-C
        start(cfg, ctx)
        return
    engine = start(cfg, ctx)
    runner = threading.Thread(target=engine.run, name="engine", daemon=True)
    runner.start()
    term = Terminal(args.history)
    try:
        code = run_repl(EngineBackend(engine, engine.tok), default_params(cfg), term)
    finally:
        term.close()
        engine.stop()
        runner.join()
    if engine.failed:
        raise RuntimeError(engine.failed)
    if code:
        raise SystemExit(code)
