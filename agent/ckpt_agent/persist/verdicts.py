"""Writing a verdict next to a COMMIT only while it still applies (:func:`write_verdict`).

A validation takes long; meanwhile the checkpoint may be retired (a resume pin
abandoned its branch: ``expired``), deleted by retention, or re-saved under the same
id. A verdict written without looking would overwrite the expiry (resurrecting an
abandoned branch, or calling it corrupted because its files were being deleted),
leave a ``VALIDATION.json`` behind for a checkpoint that no longer exists, or be bound
to a COMMIT it never judged. So the COMMIT and the stored verdict are read first.
Torch-free (the validator's module, :mod:`ckpt_agent.persist.validate`, uses it).
"""

from __future__ import annotations

import logging

from ckpt_agent.errors import CheckpointFormatError, CheckpointNotFoundError
from ckpt_agent.format.layout import validation_key
from ckpt_agent.format.readers import read_commit, read_validation
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage.base import Storage

__all__ = ["FINAL", "write_verdict"]

log = logging.getLogger(__name__)

#: Stored verdicts a validation never overwrites: a checkpoint a resume retired stays
#: retired (its files may be deleted next), a corrupted one is never offered again.
#: ``valid`` is not final: a later validation that finds it corrupted wins.
FINAL = frozenset({CheckpointStatus.EXPIRED, CheckpointStatus.CORRUPTED})


def write_verdict(storage: Storage, run_id: str, verdict: ValidationVerdict, judged: str) -> bool:
    """Write ``verdict`` (bound to the COMMIT it loaded, ``verdict.commit_sha256``) unless
    the checkpoint changed since ``judged`` (the hash of the COMMIT the caller asked to
    judge) was read; returns whether the verdict in force is this one.

    * the COMMIT is gone (deleted) or is not ``judged`` (re-saved): nothing is written
      (False) — no verdict for a checkpoint that no longer exists, none bound to a COMMIT
      it did not judge;
    * the stored verdict on this COMMIT is final (:data:`FINAL`): it stands (False; True
      when it says the same);
    * a COMMIT that cannot be read (``verdict.commit_sha256`` empty: the load could not
      read it either) has no hash to bind a verdict to: nothing is written, the
      (corrupted) outcome stands (True).

    The read and the write are separate storage calls: a verdict stored in between is
    overwritten (a window of one round trip, not of a whole validation).
    """
    cid = verdict.checkpoint_id
    try:
        current = read_commit(storage, run_id, cid).manifest_hash
    except CheckpointNotFoundError:
        log.info("verdict on %s not recorded: its COMMIT is gone (deleted)", cid)
        return False
    except CheckpointFormatError:
        current = ""  # unreadable: listed corrupted by every reader, nothing to bind to
    if not verdict.commit_sha256:
        return current == ""  # (readable now: re-saved meanwhile, not what was judged)
    if current != judged or verdict.commit_sha256 != judged:
        log.info(
            "verdict on %s (%s) not recorded: its COMMIT changed while it was validated",
            cid,
            verdict.status.value,
        )
        return False
    stored = read_validation(storage, run_id, cid)
    if stored is not None and stored.commit_sha256 == judged and stored.status in FINAL:
        if stored.status == verdict.status:
            return True
        log.info(
            "verdict on %s (%s) not recorded: it is %s already (%s)",
            cid,
            verdict.status.value,
            stored.status.value,
            stored.reason,
        )
        return False
    storage.commit(validation_key(run_id, cid), verdict.to_bytes())
    return True
