"""The vocabulary every layer shares: names (``constants``), settings (``config``), JSON
Patch (``jsonpatch``) and reading job objects (``jobs``). Pure; the bottom layer."""
