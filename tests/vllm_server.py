"""vLLM's OpenAI server for the plugin tests: started on a free localhost port, waited for,
terminated on the way out (also after a failure).

Usage:
    with openai_server(tmp_path, model_dir, {"TENSORBEND_COUNTERS": ...}) as (client, model):
        client.completions.create(model=model, prompt="...", max_tokens=8, temperature=0)
"""

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def openai_server(tmp_path: Path, model_dir, env: dict):
    from openai import APIConnectionError, OpenAI

    port = free_port()
    full = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT), **env}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--dtype", "float32", "--port", str(port), "--max-model-len", "512",
           "--enforce-eager", "--no-enable-prefix-caching"]  # fmt: skip
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")
    server = subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for _ in range(240):
            assert server.poll() is None, log_path.read_text()[-3000:]
            try:
                model = client.models.list().data[0].id
                break
            except APIConnectionError:  # the server is still starting
                time.sleep(0.5)
        else:
            pytest.fail("vLLM server not up in 120 s: " + log_path.read_text()[-3000:])
        yield client, model
    finally:
        server.terminate()
        server.wait(60)
        log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
