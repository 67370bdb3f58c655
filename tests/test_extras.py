"""`pip install mpinfer` serves int8 models without the extras: generate and the server run with
transformers and bitsandbytes made unimportable, and asking for what an extra provides says
which extra to install."""

from __future__ import annotations

import subprocess
import sys

import httpx
import tomllib

from mpinfer.startup.launcher import free_port
from mpinfer.tools.serverproc import wait_ready

from .conftest import ENV, ROOT

# Run mpinfer's CLI as if these packages were not installed (an import of them fails).
WITHOUT = """
import sys
for name in ("transformers", "bitsandbytes", "aiohttp"):
    sys.modules[name] = None
from mpinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def mpinfer_without_extras(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT, *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, **kw)  # fmt: skip


def test_the_base_install_names_no_extra_as_a_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"])
    assert "transformers" not in base and "bitsandbytes" not in base
    extras = project["optional-dependencies"]
    assert any("bitsandbytes" in d for d in extras["llm-int8"])
    assert any("transformers" in d for d in extras["bench"])


def test_int8_generation_and_the_server_run_without_transformers_or_bitsandbytes(ckpts, tmp_path):
    proc = mpinfer_without_extras("generate", "--model", str(ckpts["st_sharded"]), "--greedy",
                                  "--json", "--max-new-tokens", "4", timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"finish_reason"' in proc.stdout
    port = free_port(below_ephemeral=True)
    cmd = [sys.executable, "-c", WITHOUT, "serve", "--model", str(ckpts["st_sharded"]), "--port",
           str(port)]  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "w") as f:
        server = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=f, stderr=subprocess.STDOUT)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    try:
        assert wait_ready(f"http://127.0.0.1:{port}", server, 60), log.read_text()[-2000:]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_missing_extra_is_named(ckpts):
    proc = mpinfer_without_extras("generate", "--model", str(ckpts["st_sharded"]), "--quant",
                                  "llm.int8", timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "pip install 'mpinfer[llm-int8]'" in proc.stderr
    assert "quant.method='llm.int8' needs bitsandbytes" in proc.stderr
    assert "Traceback" not in proc.stderr
