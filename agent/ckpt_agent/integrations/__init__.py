"""Adapters that map a framework's checkpoint hooks onto the agent's core.

Each module is optional and imports its framework lazily: ``dcp``
(``torch.distributed.checkpoint`` storage writer and reader, hence torchtitan).
"""
