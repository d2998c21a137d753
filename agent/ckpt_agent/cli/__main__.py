"""``python -m ckpt_agent.cli …``: the ``ckpt`` command (e.g. the local persister's
``python -m ckpt_agent.cli sidecar --exit-with-trainer``)."""

from ckpt_agent.cli.main import main

main()
