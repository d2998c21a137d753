"""The on-storage checkpoint format (torch-free; specified in ``docs/format.md``).

* :mod:`~ckpt_agent.format.layout`: format constants, run/checkpoint names, storage keys,
  canonical JSON, SHA-256.
* :mod:`~ckpt_agent.format.schema`: typed field access for parsing the documents.
* :mod:`~ckpt_agent.format.entries`: a rank manifest's blob and tensor entries.
* :mod:`~ckpt_agent.format.manifest`: the documents (rank manifest, COMMIT).
* :mod:`~ckpt_agent.format.verdict`: the validator's verdict (``ValidationVerdict``).
* :mod:`~ckpt_agent.format.readers`: reading them back with every hash checked, tensor bytes.
* :mod:`~ckpt_agent.format.listing`: runs and committed checkpoints in storage.
* :mod:`~ckpt_agent.format.verify`: streaming hash verification of a checkpoint.
* :mod:`~ckpt_agent.format.heartbeat`: the L0 heartbeat ring.
* :mod:`~ckpt_agent.format.owner`: the namespace a run belongs to (``OWNER.json``).
* :mod:`~ckpt_agent.format.codec`, :mod:`~ckpt_agent.format.shuffle`: blob encodings;
  :mod:`~ckpt_agent.format.jsontree`: the tagged-JSON state tree;
  :mod:`~ckpt_agent.format.parts`: checking a rank's part before the COMMIT.
"""
