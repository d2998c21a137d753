"""Every error the agent raises on purpose, in one place (torch-free, no I/O).

One base, :class:`CkptError`, and two kinds a caller can act on without reading
the message:

* :class:`RetryableError` — transient (a timeout, a 5xx, a busy peer); trying
  again later may succeed.
* :class:`PermanentError` — retrying will not help (bad input, corrupt bytes,
  missing bucket, no space); the message says what to fix.

Code decides on the *type* (and on typed fields such as
:attr:`CandidateRejectedError.kind`), never on the words of a message. The concrete
classes keep the builtin bases their callers historically caught
(``ValueError``, ``LookupError``, ``FileNotFoundError``, ``RuntimeError``).
"""

from __future__ import annotations

import enum
from typing import ClassVar

from ckpt_agent.text import clean

__all__ = [
    "CandidateRejectedError",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CkptError",
    "CodecError",
    "CommitAbortedError",
    "DistributedError",
    "FencedError",
    "ForceRequiredError",
    "IntegrityError",
    "JsonTreeError",
    "NotFoundError",
    "PeerUnreachableError",
    "PermanentError",
    "PermanentStorageError",
    "PersistError",
    "RejectionKind",
    "ReplicaAuthError",
    "ReplicaError",
    "ReplicaIntegrityError",
    "ResumeError",
    "RetryableError",
    "RetryableStorageError",
    "RunOwnershipError",
    "ServeError",
    "ShmError",
    "StepOrderError",
    "StorageError",
    "TerminationReportError",
    "UnsafePathError",
    "one_line",
]


class CkptError(Exception):
    """Base of every error the agent raises on purpose."""

    #: Whether the same call may succeed if tried again later.
    retryable: ClassVar[bool] = False


class RetryableError(CkptError):
    """Transient: trying again later may succeed."""

    retryable = True


class PermanentError(CkptError):
    """Retrying will not help; the message says what to fix."""

    retryable = False


# --------------------------------------------------------------------------- storage


class StorageError(CkptError):
    """Base class of storage failures."""

    #: The backend's own error code (S3: ``InvalidRange``, ``NoSuchUpload`` ...), when it
    #: gave one: what callers decide on, never the message text.
    code: str | None = None


class PermanentStorageError(StorageError, PermanentError):
    """Retrying will not help (bad credentials, missing bucket, no space, permissions).

    The message says what to fix.
    """


class RetryableStorageError(StorageError, RetryableError):
    """A transient failure (timeout, 5xx, throttling) that survived the retry budget."""


class NotFoundError(StorageError, PermanentError, FileNotFoundError):
    """The key does not exist."""


class UnsafePathError(PermanentStorageError):
    """A key leads to something that is not a regular file or folder (a symbolic link,
    a FIFO, a device) planted in the store; it is refused, never followed or read."""


# --------------------------------------------------------------------------- format


class CheckpointFormatError(PermanentError, ValueError):
    """A manifest or COMMIT is malformed (not JSON, wrong schema, unknown version)."""


class TerminationReportError(CheckpointFormatError):
    """A container's termination message is not a readable checkpoint report (wrong format,
    version or schema); the reader ignores it and uses what else it knows."""


class RunOwnershipError(PermanentError):
    """The run belongs to another Kubernetes namespace (its ``OWNER.json``): a job may only
    continue runs of its own namespace; the message says which run id to change."""


class CheckpointNotFoundError(PermanentError, LookupError):
    """No committed checkpoint with that id (or no such run)."""


class IntegrityError(PermanentError, ValueError):
    """Stored bytes do not match their recorded SHA-256 or size (flipped, truncated, missing)."""


class CodecError(PermanentError, ValueError):
    """Stored bytes cannot be decoded (unknown codec, bad frame, wrong size)."""


class JsonTreeError(PermanentError, ValueError):
    """A tree cannot be encoded, or an encoded tree is malformed."""


# --------------------------------------------------------------------------- decisions


class ForceRequiredError(PermanentError, RuntimeError):
    """Raised by :meth:`RecoveryPlan.require_first` when only forced steps remain."""


class RejectionKind(enum.StrEnum):
    """Why a candidate checkpoint was not restored (recorded, never parsed from prose)."""

    MISSING = "missing"  # a manifest, blob or COMMIT is gone
    INTEGRITY = "integrity"  # bytes do not match their hash or size
    FORMAT = "format"  # malformed manifest, tree or payload
    INCOMPATIBLE = "incompatible"  # shapes/dtypes/keys do not fit the live model
    MARKED = "marked"  # already marked corrupted/superseded in the catalog
    STORAGE = "storage"  # the storage refused a read (not the checkpoint's fault: not marked)
    TOO_LARGE = "too_large"  # more than this machine's memory holds (not marked corrupted)

    @property
    def corrupted(self) -> bool:
        """Whether this rejection marks the checkpoint corrupted (its own bytes are bad).

        A storage failure proves nothing about the bytes (an EIO, a refused request):
        such a checkpoint is never marked; a transient one fails the start instead
        (:class:`ResumeStorageError`), so a good checkpoint is never given up for it.
        """
        return self in (RejectionKind.MISSING, RejectionKind.INTEGRITY, RejectionKind.FORMAT)


# --------------------------------------------------------------------------- runtime


class CheckpointError(CkptError, RuntimeError):
    """Base class of the engine's errors."""


class PersistError(CheckpointError):
    """A background persist failed (raised once, on the next call).

    :attr:`transient`: every failure behind it was a :class:`RetryableError` (a later
    save may succeed).
    """

    transient: bool = False
    saves_failed: bool = False
    """Some failure behind it was a save (never committed), not only a validation."""


class FencedError(CheckpointError, PermanentError):
    """A newer writer holds this run (a higher generation in ``<run>/writers/``): this
    process must not write or delete in it any more.

    Fatal whatever ``on_persist_error`` says, and sticky: every later ``step()``,
    ``save_now()``, ``wait()`` and ``close()`` raises it again. :attr:`holder` names the
    newer writer (generation, pod, node, namespace) for the message and the Event.
    """

    def __init__(self, message: str, *, generation: int, holder: str) -> None:
        super().__init__(message)
        self.generation = generation
        """This writer's generation."""
        self.holder = holder
        """The newer writer, in words."""


class ResumeError(CheckpointError, PermanentError):
    """The requested/required checkpoint cannot be restored (never a silent fresh start)."""


class StepOrderError(CheckpointError, PermanentError, ValueError):
    """A step that is not after one already saved on the same run and lineage (a restarted
    counter, a call per micro-batch, a second experiment on the same run id): refused,
    because it would overwrite newer data or make retention delete the newer checkpoint
    (retention orders by step). The message names what to do."""


class ResumeStorageError(CheckpointError, RetryableError):
    """The storage kept failing (transiently) while a checkpoint was read at start.

    The start fails rather than resume from an older checkpoint (a rewind) or mark a
    good one corrupted; the container's restart (or the operator's) tries again.
    """


class CandidateRejectedError(ResumeError):
    """One candidate checkpoint cannot be restored; the recovery ladder tries the next one.

    :attr:`kind` says why (:attr:`RejectionKind.corrupted` kinds are marked
    corrupted); raised before anything of the candidate is applied, or after a
    failed apply (then every later candidate overwrites what it touched).
    """

    def __init__(self, checkpoint_id: str, kind: RejectionKind, reason: str) -> None:
        super().__init__(f"{checkpoint_id}: {reason}")
        self.checkpoint_id = checkpoint_id
        self.kind = kind
        self.reason = reason


class DistributedError(CkptError, RuntimeError):
    """Ranks disagree, or a collective failed (a rank died or hung)."""


class CommitAbortedError(DistributedError):
    """The two-phase commit published no COMMIT (a rank failed, died or disagreed)."""


class ShmError(CkptError, RuntimeError):
    """The shared-memory area is unusable (wrong owner, torn snapshot, bad descriptor)."""


class ReplicaError(CkptError, RuntimeError):
    """A peer replica of a flash snapshot could not be pushed or read: the peer is
    unreachable or too slow, refused the request, or broke the wire protocol (a later
    push, or another source, may succeed)."""

    retryable: ClassVar[bool] = True


class ServeError(CkptError):
    """An agent's HTTP server (``/metrics``, ``/healthz``) cannot listen where it was told:
    the port is taken, or the address is not this host's."""


class PeerUnreachableError(ReplicaError):
    """No connection to a replica peer (``refused``: nothing listens on its port yet, e.g.
    its sidecar is starting)."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class ReplicaAuthError(ReplicaError, PermanentError):
    """A replica peer is not of this job: it does not hold the job's secret, or it serves
    another namespace or job id (:mod:`ckpt_agent.flash.replica.auth`)."""

    retryable: ClassVar[bool] = False


class ReplicaIntegrityError(ReplicaError, IntegrityError):
    """A replica's bytes do not match their SHA-256 (corrupted in flight or at rest): the
    replica is unusable; recovery takes the next source."""

    retryable: ClassVar[bool] = False


def one_line(e: BaseException) -> str:
    """``e`` for a person, on one line: our errors say what is wrong; any other is named by
    its type too (a reader met something the format does not allow). Through
    :func:`ckpt_agent.text.clean`: the message may quote stored text (a file name, a
    reason), so controls are escaped and the length capped (``DEFAULT_LIMIT``)."""
    text = str(e) if isinstance(e, CkptError) else f"{type(e).__name__}: {e}"
    return clean(" ".join(text.split()))
