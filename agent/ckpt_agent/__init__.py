"""ckpt_agent: the in-pod checkpointing agent.

Importing this package is cheap and torch-free; the operator imports the pure
parts (``policy``, ``records``, ``retention``, ``recovery``, ``manifest``).
The torch-facing API is ``ckpt_agent.engine.Checkpointer``.
"""

__version__ = "0.1.0"
