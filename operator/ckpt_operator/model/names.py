"""Names the operator derives for the objects it makes or mounts (ConfigMaps, Secrets)."""

from __future__ import annotations

import hashlib
from typing import Final

__all__ = ["MAX_OBJECT_NAME", "derived_name"]

#: The longest name a Kubernetes object (a DNS subdomain) may have.
MAX_OBJECT_NAME: Final = 253


def derived_name(prefix: str, name: str) -> str:
    """``<prefix><name>``, deterministic; a name too long for an object keeps its start and
    ends in 8 hex digits of its SHA-256, so two long names never meet."""
    full = f"{prefix}{name}"
    if len(full) <= MAX_OBJECT_NAME:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{prefix}{name[: MAX_OBJECT_NAME - len(prefix) - 9]}-{digest}"
