"""What both framework adapters share: the framework import, late-bound state, the RNG hold."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ckpt_agent.errors import CheckpointError

__all__ = ["IntegrationError", "LateState", "require"]


class IntegrationError(CheckpointError):
    """The framework integration is used in a way that would not resume exactly."""


def require(module: str, extra: str, pin: str) -> ModuleType:
    """Import ``module`` or say which extra installs it (the core never imports a framework)."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"ckpt_agent.integrations needs {pin} for this adapter: "
            f"pip install 'ckpt-operator[{extra}]' (or pip install '{pin}'); {err}"
        ) from err


class LateState:
    """A ``state_dict``/``load_state_dict`` slot for an object the framework creates later.

    The checkpointer is started (and the checkpoint chosen and restored) before the
    framework has built, say, its LR scheduler; the restored state is held here and
    applied by :meth:`attach` at the moment the framework expects it. Saves read the
    attached object.
    """

    def __init__(self, name: str, get: Callable[[], Any] | None = None) -> None:
        self._name = name
        self._get = get
        self._obj: Any = None
        self._held: dict[str, Any] | None = None

    def current(self) -> Any:
        if self._obj is None and self._get is not None:
            self._obj = self._get()
        return self._obj

    def state_dict(self) -> dict[str, Any]:
        obj = self.current()
        if obj is None:
            return {}
        sd = getattr(obj, "state_dict", None)
        if not callable(sd):
            raise IntegrationError(
                f"the {self._name} ({type(obj).__name__}) has no state_dict(): it cannot be "
                "checkpointed exactly"
            )
        out = sd()
        assert isinstance(out, dict)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        obj = self.current()
        if obj is not None:
            obj.load_state_dict(state)
        else:
            self._held = dict(state)

    def attach(self, obj: Any) -> None:
        """The framework's object now exists: apply the held state (once), save it from now on."""
        self._obj = obj
        if self._held is not None and obj is not None:
            obj.load_state_dict(self._held)
        self._held = None
