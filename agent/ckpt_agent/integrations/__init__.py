"""Adapters that map a framework's checkpoint hooks onto the agent's core.

Each module is optional and imports its framework itself, with a readable
:class:`ImportError` naming the extra to install when it is missing (importing this
package imports no framework; the core never imports one):

* ``dcp`` — a ``torch.distributed.checkpoint`` storage writer and reader (hence torchtitan);
* ``transformers`` — a ``TrainerCallback`` for a stock Hugging Face ``Trainer``
  (extra ``hf``; ``docs/integrations/transformers.md``);
* ``lightning`` — a Lightning ``Callback`` and a resumable sampler
  (extra ``lightning``; ``docs/integrations/lightning.md``).

What an adapter needs that the core lacks goes into the core (the RNG restore point,
the step lineage), not into the adapter.
"""
