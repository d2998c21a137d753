"""DCP's ``Metadata`` as JSON and back (no pickle), and checkpoint ids naming steps."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt_agent.errors import CheckpointFormatError
from ckpt_agent.integrations.dcp import metadata_from_json, metadata_to_json, step_of


def _metadata() -> Metadata:
    w = TensorStorageMetadata(
        TensorProperties(dtype=torch.bfloat16, requires_grad=True),
        torch.Size([8, 4]),
        [
            ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4])),
            ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 4])),
        ],
    )
    return Metadata(
        state_dict_metadata={"model.w": w, "train_state.step": BytesStorageMetadata()},
        planner_data={"model.w": ("model", "w"), "opt.state.0": ("opt", "state", 0)},
        storage_meta=StorageMeta(checkpoint_id="/ckpt/step-200", save_id="abc", modules=["m"]),
        version="1.0.0",
    )


def test_metadata_round_trips_through_plain_json() -> None:
    md = _metadata()
    tree = metadata_to_json(md)
    back = metadata_from_json(json.loads(json.dumps(tree)))
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data  # tuple paths stay tuples, ints stay ints
    assert back.storage_meta == md.storage_meta and back.version == "1.0.0"


def test_metadata_from_bad_json_is_refused_naming_it() -> None:
    tree = metadata_to_json(_metadata())
    assert isinstance(tree, dict)
    entry = tree["state_dict_metadata"]["model.w"]  # type: ignore[index]
    entry["chunks"][1]["offsets"] = [6, 0]  # runs past the tensor's 8 rows
    with pytest.raises(CheckpointFormatError, match="outside its tensor"):
        metadata_from_json(tree)
    with pytest.raises(CheckpointFormatError, match="not DCP metadata"):
        metadata_from_json({"x": 1})


def test_planner_data_json_cannot_hold_is_refused_at_save() -> None:
    md = _metadata()
    md.planner_data = {"x": object()}
    with pytest.raises(CheckpointFormatError, match="planner_data"):
        metadata_to_json(md)


@pytest.mark.parametrize(
    ("cid", "step"),
    [("step-200", 200), ("/ckpt/run/step_7/", 7), ("full_step_000000000042", 42), ("9", 9)],
)
def test_a_checkpoint_id_names_its_step(cid: str, step: int) -> None:
    assert step_of(cid) == step


def test_a_checkpoint_id_without_a_step_is_refused() -> None:
    with pytest.raises(ValueError, match="names no step"):
        step_of("latest")
