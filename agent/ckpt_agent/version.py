"""The agent's version: a leaf module, so a layer that records it imports no package facade."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
