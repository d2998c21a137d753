"""The vocabulary every layer shares: names (``constants``), settings (``config``), JSON
Patch (``jsonpatch``), typed views over Kubernetes objects (``bodies``) and reading job
objects (``jobs``). Pure; the bottom layer."""
