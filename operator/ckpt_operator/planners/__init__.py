"""Pure decisions and builders: what to inject, how to restart, what to delete, which
status to write. No I/O (no kopf, Kubernetes client, HTTP or storage: a contract in
``pyproject.toml``); what needs the outside world is passed in (a verification callable,
facts read by the behaviours)."""
