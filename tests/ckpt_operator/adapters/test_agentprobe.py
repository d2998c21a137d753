"""The agent probe against real sockets: the agent's own metrics server, a closed port,
another HTTP server, a listener that never answers."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from collections.abc import Iterator

import pytest

from ckpt_agent.metrics import Metrics
from ckpt_operator.adapters.agentprobe import probe_agent
from ckpt_operator.planners.agent_presence import Presence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_closed_port_is_absent() -> None:
    port = _free_port()
    result = asyncio.run(probe_agent("127.0.0.1", port, 5))
    assert result.presence is Presence.ABSENT
    assert result.detail == f"127.0.0.1:{port} refused the connection"


@pytest.fixture
def other_server() -> Iterator[int]:
    class Hello(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"hello\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            del format, args

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield int(httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_another_server_on_the_port_is_no_verdict(other_server: int) -> None:
    result = asyncio.run(probe_agent("127.0.0.1", other_server, 5))
    assert result.presence is Presence.UNKNOWN
    assert "not the agent's metrics" in result.detail


def test_a_listener_that_never_answers_is_no_verdict() -> None:
    with socket.socket() as listener:  # accepts (the backlog) but never reads or writes
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = int(listener.getsockname()[1])
        result = asyncio.run(probe_agent("127.0.0.1", port, 0.3))
    assert result.presence is Presence.UNKNOWN
    assert "did not answer within 0.3s" in result.detail


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("bind", "ip"),
    [
        ("127.0.0.1", "127.0.0.1"),
        pytest.param(
            "::",
            "::1",
            marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
    ],
    ids=["ipv4", "ipv6"],
)
def test_the_agents_metrics_server_is_serving(bind: str, ip: str) -> None:
    """The agent's own server answers the probe; ``CKPT_METRICS_ADDR=::`` serves IPv6 (an
    IPv6 pod's address) and the probe speaks to a bracketed IPv6 host."""
    metrics = Metrics()
    port = _free_port()
    metrics.serve(port, bind)
    try:
        result = asyncio.run(probe_agent(ip, port, 5))
    finally:
        metrics.close()
    assert result.presence is Presence.SERVING, result
    assert result.detail == f"the agent serves {ip}:{port}"
