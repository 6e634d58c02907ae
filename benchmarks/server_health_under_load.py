"""``/health`` latency while one client sends a 4 MB prompt and another asks for 128
completions with 20 top logprobs each: the event loop must keep answering (target: p99
under 200 ms on this machine).

``hybridkv serve`` runs as a subprocess over the tests' tiny checkpoint, with a context
(320k tokens) large enough that the 4 MB prompt is really tokenized (in the server's worker
process) before it is refused for length; a poller GETs ``/health`` every 20 ms. Phases, in
order: idle, the 4 MB prompt (sent 3 times, one after the other), the 128 x 20-logprob
request (max_tokens 16, whole response, then streamed), both at once. Prints p50 / p99 / max
of the ``/health`` latency per phase. Run: ``python benchmarks/server_health_under_load.py``.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_common import build_tiny_checkpoint, machine_line

MODEL = "bench"
FLOOD = {"model": MODEL, "prompt": "Many logprobs", "n": 128, "logprobs": 20, "max_tokens": 16,
         "ignore_eos": True}  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(model_dir: Path, port: int) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "hybridkv", "serve", "--model", str(model_dir), "--port", str(port),
        "--served-model-name", MODEL, "--max-model-len", "320000", "--cache-memory-gib", "0.5",
        "--max-body-mib", "8", "--log-level", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(
                f"the server did not start: {proc.stderr.read() if proc.stderr else ''}"
            )
        time.sleep(0.2)


def poll_health(base: str, stop: threading.Event, latencies: list[float]) -> None:
    with httpx.Client(base_url=base, timeout=60) as http:
        while not stop.is_set():
            started = time.perf_counter()
            http.get("/health")
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)


def big_prompt(base: str, repeats: int) -> str:
    text = "The quick brown fox jumps over the lazy dog. " * (4_000_000 // 45)
    codes = []
    with httpx.Client(base_url=base, timeout=300) as http:
        for _ in range(repeats):
            body = {"model": MODEL, "prompt": text, "max_tokens": 1}
            codes.append(http.post("/v1/completions", json=body).status_code)
    return f"4 MB prompt x{repeats}: status {codes}"


def flood(base: str) -> str:
    with httpx.Client(base_url=base, timeout=600) as http:
        started = time.perf_counter()
        whole = http.post("/v1/completions", json=FLOOD)
        seconds = time.perf_counter() - started
        size = len(whole.content)
        streamed = 0
        with http.stream("POST", "/v1/completions", json={**FLOOD, "stream": True}) as response:
            for chunk in response.iter_bytes():
                streamed += len(chunk)
    return (f"128 x 20-logprob request: status {whole.status_code}, {size / 1e6:.1f} MB in "
            f"{seconds:.1f} s; streamed {streamed / 1e6:.1f} MB")  # fmt: skip


def phase(base: str, name: str, work: list[Callable[[], str]], idle_s: float = 0.0) -> None:
    stop = threading.Event()
    latencies: list[float] = []
    poller = threading.Thread(target=poll_health, args=(base, stop, latencies))
    poller.start()
    notes: list[str] = []
    threads = [threading.Thread(target=lambda w=w: notes.append(w())) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(idle_s)
    stop.set()
    poller.join()
    latencies.sort()
    p50 = statistics.median(latencies) * 1e3
    p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3
    worst = latencies[-1] * 1e3
    print(f"  {name:26} /health p50 {p50:7.1f} ms  p99 {p99:7.1f} ms  max {worst:7.1f} ms"
          f"  ({len(latencies)} probes)")  # fmt: skip
    for note in notes:
        print(f"      {note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        _, model_dir = build_tiny_checkpoint(Path(tmp) / "ckpt")
        port = free_port()
        proc = start_server(model_dir, port)
        base = f"http://127.0.0.1:{port}"
        try:
            print(machine_line())
            print("hybridkv serve, tiny Qwen3.5, max_model_len 320000 (a 4 MB prompt is tokenized)")
            phase(base, "idle", [], idle_s=3.0)
            phase(base, "4 MB prompt", [lambda: big_prompt(base, args.prompt_repeats)])
            phase(base, "128 x 20 logprobs", [lambda: flood(base)])
            phase(base, "both at once", [lambda: big_prompt(base, 1), lambda: flood(base)])
        finally:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
