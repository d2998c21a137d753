"""``ckpt recover --job J --step N --reason ...``: ask the operator for a manual recovery.

The request is a set of annotations on the failed PyTorchJob (the operator's
:mod:`ckpt_operator.planners.manual` acts on them, even after ``GaveUp``). The agent
package does not talk to Kubernetes itself: this runs ``kubectl annotate``
(``$KUBECTL`` names another binary), with the caller's kubeconfig and rights.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

from ckpt_agent.cli.common import ExitCode, fail, safe, say
from ckpt_agent.persist.housekeeping import who

__all__ = ["ANNOTATIONS", "annotate_command", "request_recovery"]

#: The request's annotation keys (the operator's ``ckpt_operator.model.constants``; a test
#: keeps both in step).
ANNOTATIONS = {
    "step": "ckpt.dev/recover-step",
    "by": "ckpt.dev/recover-by",
    "reason": "ckpt.dev/recover-reason",
    "force": "ckpt.dev/recover-force",
    "dry_run": "ckpt.dev/recover-dry-run",
}

#: Seconds ``kubectl annotate`` may take.
KUBECTL_TIMEOUT_S = 60.0


def annotate_command(
    job: str,
    namespace: str | None,
    *,
    step: int,
    reason: str,
    by: str,
    force: bool,
    dry_run: bool,
    kubectl: str = "kubectl",
) -> list[str]:
    """The ``kubectl annotate`` argv that files the request (``--overwrite``: a new
    request replaces an older one)."""
    values = {
        "step": str(step),
        "by": by,
        "reason": reason,
        "force": str(force).lower(),
        "dry_run": str(dry_run).lower(),
    }
    argv = [kubectl, "annotate", "pytorchjob", job, "--overwrite"]
    if namespace:
        argv += ["--namespace", namespace]
    return argv + [f"{ANNOTATIONS[k]}={v}" for k, v in values.items()]


def request_recovery(
    job: str,
    namespace: str | None,
    step: int | None,
    *,
    reason: str,
    force: bool,
    dry_run: bool,
    environ: Mapping[str, str] | None = None,
) -> None:
    """File the request on the job; the operator answers with Events on it."""
    if step is None:
        raise fail("--job needs --step N (the global step to resume from)")
    if not reason.strip():
        raise fail("--job needs --reason: the operator records who asked and why")
    env = dict(environ) if environ is not None else dict(os.environ)
    kubectl = env.get("KUBECTL") or "kubectl"
    if shutil.which(kubectl, path=env.get("PATH")) is None:
        raise fail(f"{kubectl!r} not found: install kubectl or set KUBECTL to its path")
    argv = annotate_command(
        job,
        namespace,
        step=step,
        reason=reason.strip(),
        by=who(),
        force=force,
        dry_run=dry_run,
        kubectl=kubectl,
    )
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=KUBECTL_TIMEOUT_S, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise fail(f"{' '.join(argv[:4])} failed: {err}", ExitCode.PROBLEM) from err
    if done.returncode != 0:
        raise fail(
            f"kubectl annotate failed (exit {done.returncode}): {done.stderr.strip()}; "
            "check the job name, namespace and your rights",
            ExitCode.PROBLEM,
        )
    what = "a dry run (the plan is reported, nothing changes)" if dry_run else "a restart"
    say(
        safe(
            f"asked the operator for {what} of pytorchjob {job} from step {step}"
            + (" (forced)" if force else "")
            + f"; see `kubectl describe pytorchjob {job}` for its Events",
            None,
        )
    )
