"""Just-in-time saves under a real Hugging Face ``Trainer`` (#31): the forward pass of step 13
raises (a peer's all-reduce failing, say); the script hands the exception to
``CheckpointCallback.save_on_failure`` (the snippet of docs/integrations/transformers.md),
which saves step 12 to shared memory; the next ``train()`` resumes at step 13 and ends with
the weights and optimizer state of the uninterrupted run, bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_lightning_jit import _config

from ckpt_agent.storage.fs import LocalStorage
from ckpt_e2e.local_flash import same_state, sidecar_thread

pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

STEPS, FAIL_AT = 20, 13


class FailedError(RuntimeError):
    pass


def _train(root: Path, fail_at: int = -1) -> dict[str, Any]:
    from fw_workers import _hf_setup
    from transformers import Trainer

    from ckpt_agent.integrations.transformers import CheckpointCallback

    model, args, ds = _hf_setup(root, STEPS, 1)
    callback = CheckpointCallback(_config(root), storage=LocalStorage(root / "store"))
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[callback])

    def fail(module: Any, inputs: Any) -> None:
        if module.training and trainer.state.global_step == fail_at:
            raise FailedError(f"step {fail_at}: the all-reduce failed")

    model.register_forward_pre_hook(fail)
    try:  # the snippet of docs/integrations/transformers.md
        trainer.train(resume_from_checkpoint=callback.resume(trainer))
    except Exception as err:
        callback.save_on_failure(err)
        raise
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "opt": trainer.optimizer.state_dict(),
        "global_step": trainer.state.global_step,
    }


def test_a_failed_trainer_step_costs_only_that_step(tmp_path: Path) -> None:
    with sidecar_thread(_config(tmp_path / "ref")):
        want = _train(tmp_path / "ref")
    root = tmp_path / "failed"
    with sidecar_thread(_config(root)):
        with pytest.raises(FailedError):
            _train(root, fail_at=FAIL_AT)
        got = _train(root)
    assert got["global_step"] == want["global_step"] == STEPS
    assert same_state(got, want)
    events = [
        json.loads(x) for x in (root / "work" / "decisions.rank0.jsonl").read_text().splitlines()
    ]
    (saved,) = [e for e in events if e["event"] == "jit_save"]
    assert (saved["outcome"], saved["step"]) == ("saved", FAIL_AT - 1), saved
    (start,) = [e for e in events if e["event"] == "start" and e.get("checkpoint")]
    assert (start["action"], start["next_step"]) == ("resume_shm", FAIL_AT), start
