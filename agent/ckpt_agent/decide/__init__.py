"""Pure decisions (no I/O, no torch): when and what to save, what to keep, what to resume from.

``scheduler`` (composing ``signals``, ``intervals``, ``tiers``, ``decision``), ``retention``,
``recovery`` and ``lineage`` (a resume pin applied once). Everything here is a function of
its inputs, tested as tables.
"""
