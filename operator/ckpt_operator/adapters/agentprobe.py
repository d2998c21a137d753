"""Is a pod's agent serving? One HTTP request to its metrics port (I/O, asyncio only).

The agent serves its metrics from the first moment of ``Checkpointer.start()`` on the
port the webhook injected (``CKPT_METRICS_PORT``, the container port ``ckpt-metrics``).
When the operator cannot read a run's storage (a PVC mounted in the pods only), this
is its live signal of a pod whose training code never started the agent: the same
reachability Prometheus needs to scrape the pod, no mount and no pod RBAC.

Only a refused connection (the pod answered: nothing listens there) means *absent*.
A timeout, an unreachable address (a NetworkPolicy that drops the operator's traffic)
or an HTTP answer that is not the agent's metrics means *unknown*: no verdict, never a
false alarm. The probe runs on the event loop (no worker thread), bounded by ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib

from ckpt_operator.planners.agent_presence import Presence, ProbeResult

__all__ = ["probe_agent"]

#: The most bytes of the answer read: the agent's metrics name themselves early.
MAX_BODY = 256 * 1024
#: What marks the agent's metrics (every family it serves is named ``ckpt_*``).
AGENT_MARK = b"ckpt_"


async def probe_agent(ip: str, port: int, timeout: float = 2.0) -> ProbeResult:
    """Probe ``http://ip:port/metrics`` once, within ``timeout`` seconds in all."""
    where = f"{ip}:{port}"
    host = f"[{ip}]" if ":" in ip else ip
    try:
        async with asyncio.timeout(timeout):
            try:
                reader, writer = await asyncio.open_connection(ip, port)
            except ConnectionRefusedError:
                return ProbeResult(Presence.ABSENT, f"{where} refused the connection")
            try:
                writer.write(
                    f"GET /metrics HTTP/1.0\r\nHost: {host}:{port}\r\n"
                    "User-Agent: ckpt-operator-probe\r\n\r\n".encode()
                )
                await writer.drain()
                answer = b""
                while len(answer) < MAX_BODY:
                    chunk = await reader.read(MAX_BODY - len(answer))
                    if not chunk:
                        break
                    answer += chunk
                    if AGENT_MARK in answer and b"\r\n\r\n" in answer:
                        break
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        return ProbeResult(Presence.UNKNOWN, f"{where} did not answer within {timeout:g}s")
    except OSError as e:
        return ProbeResult(Presence.UNKNOWN, f"{where}: {e.strerror or e}")
    status = answer.split(b"\r\n", 1)[0]
    _, _, body = answer.partition(b"\r\n\r\n")
    if status.split(b" ")[1:2] == [b"200"] and AGENT_MARK in body:
        return ProbeResult(Presence.SERVING, f"the agent serves {where}")
    shown = status.decode("latin-1")[:80] or "nothing"
    return ProbeResult(Presence.UNKNOWN, f"{where} answered {shown!r}, not the agent's metrics")
