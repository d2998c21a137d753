"""Flash checkpoints, persister side (torch-free): the shared-memory protocol, its reader,
and the sidecar that turns snapshots into committed checkpoints (``ckpt sidecar``).
"""
