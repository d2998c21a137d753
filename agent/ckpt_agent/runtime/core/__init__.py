"""What every part of the runtime shares: the :class:`~ckpt_agent.runtime.core.context.Engine`
(services), what a snapshot holds (:mod:`~ckpt_agent.runtime.core.capture`), tensor
serialization, inline state, devices, DTensor helpers and TensorBoard scalars.

The lowest runtime layer: it imports no other runtime sub-package.
"""
