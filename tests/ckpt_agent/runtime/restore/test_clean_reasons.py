"""A reason stored in ``VALIDATION.json`` (or any rejection reason) reaches the trainer's
terminal only through ``text.clean`` (issue #28): whoever can write the store chooses it, and
a ``ResumeError`` quoting it raw could colour, retitle or forge lines of the job's log."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ckpt_agent.errors import ResumeError
from ckpt_agent.format.layout import commit_key, sha256_hex, validation_key
from ckpt_agent.format.verdict import ValidationVerdict
from ckpt_agent.policy import AgentConfig
from ckpt_agent.records import CheckpointStatus
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.text import DEFAULT_LIMIT
from tests.ckpt_agent.runtime.restore.test_hostile_checkpoints import RUN, Tiny

#: A colour, an OSC window title ended by BEL, a right-to-left override, a newline and a
#: forged second line.
EVIL = "bad\x1b[31m\x1b]0;pwned\x07\u202eevil\nERROR forged line"
RAW = ("\x1b", "\x07", "\u202e", "\n")


def test_a_forged_verdict_reason_is_escaped_and_capped_in_the_resume_error(
    ck_config: Callable[..., AgentConfig],
) -> None:
    cfg = ck_config(tiers={"heartbeat": {"enabled": False}})
    t = Tiny()
    ckpt = t.checkpointer(cfg)
    ckpt.start()
    t.run(ckpt, 0, 3)
    cid = ckpt.save_now("pinned")
    assert cid is not None and ckpt.wait(30)
    ckpt.close()
    store = LocalStorage(cfg.storage_url.removeprefix("file://"))
    raw = store.read(commit_key(RUN, cid))
    forged = ValidationVerdict(
        cid, sha256_hex(raw), CheckpointStatus.CORRUPTED, reason=EVIL * 40, validated_at=1.0
    )
    store.commit(validation_key(RUN, cid), forged.to_bytes())
    pinned = cfg.model_copy(update={"resume_from": cid})
    with pytest.raises(ResumeError) as info:
        Tiny().checkpointer(pinned).start()
    message = str(info.value)
    assert [c for c in RAW if c in message] == [], message[:300]
    assert "bad\\x1b[31m\\x1b]0;pwned\\x07\\u202eevil\\nERROR forged line" in message
    assert len(message) < 2 * DEFAULT_LIMIT and "more characters)" in message
