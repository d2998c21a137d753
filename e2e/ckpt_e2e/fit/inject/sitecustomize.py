"""Test-only: installs the FIT fault named by ``CKPT_FIT_FAULT`` in every Python process.

This folder is put on ``PYTHONPATH`` only by the FIT harness (``ckpt_e2e.fit``), so the
persister subprocess a trainer starts gets the same fault. Without ``CKPT_FIT_FAULT``
it does nothing; it never ships in an image.
"""

import os

if os.environ.get("CKPT_FIT_FAULT"):
    from ckpt_e2e.fit.faults import install_from_env

    install_from_env()
