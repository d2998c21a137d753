"""The ``ckpt`` command line (typer): ls, verify, recover, gc, sidecar."""
