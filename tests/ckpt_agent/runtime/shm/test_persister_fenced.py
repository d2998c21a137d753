"""A flash persister that was fenced (it holds the run's writer generation) makes the
trainer stop as a fenced writer does (#28): its result mark's text becomes a
:class:`FencedError` (fatal whatever ``on_persist_error`` says, sticky), not a retryable
persist error."""

from __future__ import annotations

from ckpt_agent.errors import FencedError
from ckpt_agent.format.fence import WriterRecord, fenced_error, fenced_from_text
from ckpt_agent.runtime.core.context import Handover
from tests.ckpt_agent.runtime.shm.test_persister import ConfigFactory, _persister, _save


def _text() -> str:
    """What the persister's mark says when its fence found a newer writer."""
    own = WriterRecord(1, pod="train-0", node="lost")
    holder = WriterRecord(2, pod="train-r1-0", node="spare", job="train-r1", pid=9)
    err = fenced_error("run1", own, holder)
    return f"{type(err).__name__}: {err}"


def test_a_fenced_text_parses_back_and_other_errors_do_not() -> None:
    err = fenced_from_text(_text())
    assert isinstance(err, FencedError) and err.generation == 1
    assert err.holder.startswith("generation 2: pod train-r1-0 on node spare")
    assert "Stop this process" in str(err)
    assert fenced_from_text("RetryableStorageError: timed out") is None
    odd = fenced_from_text("FencedError: something else")
    assert odd is not None and (odd.generation, odd.holder) == (0, "a newer writer")


def test_a_fenced_persister_mark_is_a_fenced_error(ck_config: ConfigFactory) -> None:
    p, target, _ = _persister(ck_config(shmDir="/dev/shm/unused"))
    p.start(Handover())
    _save(p, 1)
    target.handled(1, 1, ok=False, error=_text())
    p.poll()
    errors = p.take_errors()
    assert len(errors) == 1 and isinstance(errors[0].error, FencedError)
