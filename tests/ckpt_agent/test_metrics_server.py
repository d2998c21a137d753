"""``MetricsServer``: /metrics of one registry, and health endpoints when given a check."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from ckpt_agent.metrics import Metrics, MetricsServer


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_serves_the_registry_on_any_path_without_a_health_check() -> None:
    m = Metrics()
    srv = MetricsServer(m.registry, 0, "127.0.0.1")
    try:
        for path in ("/metrics", "/"):
            code, body = _get(srv.port, path)
            assert code == 200 and b"ckpt_last_valid_step -1.0" in body
    finally:
        srv.close()


@pytest.mark.parametrize("healthy", [True, False])
def test_health_endpoints_follow_the_check(healthy: bool) -> None:
    m = Metrics()
    srv = MetricsServer(m.registry, 0, "127.0.0.1", health=lambda: (healthy, {"ok": healthy}))
    try:
        for path in ("/healthz", "/readyz"):
            code, body = _get(srv.port, path)
            assert code == (200 if healthy else 503) and json.loads(body) == {"ok": healthy}
        assert _get(srv.port, "/nope")[0] == 404
        assert _get(srv.port, "/metrics")[0] == 200
    finally:
        srv.close()


def test_metrics_serve_and_close_release_the_port() -> None:
    m = Metrics()
    m.serve(0)  # port 0: no server
    assert m._server is None
    probe = MetricsServer(m.registry, 0, "127.0.0.1")
    port = probe.port
    probe.close()
    m.serve(port, "127.0.0.1")
    try:
        assert _get(port, "/metrics")[0] == 200
    finally:
        m.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
