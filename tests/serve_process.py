"""Helpers of the tests that run ``hybridkv serve`` as a subprocess, as a user would."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# how long a server may take to come up: its first start on a machine builds the compiled
# packages of its model layout (the GDN steps, the decode and prefill graphs: ~3 min on a
# busy 2-core CPU; hybridkv.ops.ahead_of_time), later starts load them in seconds
START_TIMEOUT_S = 300


def wait_until_serving(proc: subprocess.Popen[str], port: int, timeout_s: float) -> None:
    """Poll ``/health`` until it answers 200; fail with the server's output if it exits first,
    and with a plain message if it is not up within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "hybridkv serve did not come up"
        time.sleep(0.2)
