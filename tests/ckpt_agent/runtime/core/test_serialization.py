"""Pickle-free payloads: state flattening, exact RNG round trips, loading, malicious files."""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckpt_agent.errors import CheckpointFormatError, IntegrityError
from ckpt_agent.format import jsontree
from ckpt_agent.format.layout import blob_key, rank_manifest_key, sha256_hex
from ckpt_agent.format.manifest import CheckpointMeta
from ckpt_agent.format.readers import read_checkpoint
from ckpt_agent.persist.encoding import CodecPolicy
from ckpt_agent.persist.validate import load_check
from ckpt_agent.persist.writer import CheckpointWriter, TensorSource
from ckpt_agent.policy.models import Tier
from ckpt_agent.records import checkpoint_id
from ckpt_agent.runtime.core.serialization import (
    LiveArray,
    capture_rng,
    flatten,
    load_tensors,
    raw_bytes,
    restore_rng,
)
from ckpt_agent.storage.fs import LocalStorage

RUN = "run1"


def _training_objects(seed: int = 0) -> tuple[torch.nn.Module, Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Dropout(0.1), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        ],
        milestones=[2],
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    return model, opt, sched, scaler


def _train(model: torch.nn.Module, opt: Any, sched: Any, scaler: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(4, 6)).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
    return losses


def _save(store: LocalStorage, step: int, sections: dict[str, object], **policy: Any) -> str:
    live: dict[str, LiveArray] = {}
    tree = {name: flatten(value, name, live) for name, value in sections.items()}
    copies = {
        n: (a.value.clone() if isinstance(a.value, torch.Tensor) else a.value.copy())
        for n, a in live.items()
    }
    srcs = [TensorSource(n, live[n].dtype, live[n].shape, raw_bytes(c)) for n, c in copies.items()]
    w = CheckpointWriter(
        store, RUN, codec=CodecPolicy(**policy) if policy else None, chunk_bytes=1024
    )
    meta = CheckpointMeta(run_id=RUN, step=step, tier=Tier.PULSE, sections=tuple(sections))
    w.commit(meta, [w.write_rank(meta, 0, tree, srcs)])
    return checkpoint_id(Tier.PULSE, step)


def _load(store: LocalStorage, cid: str) -> dict[str, object]:
    _, manifest = read_checkpoint(store, RUN, cid)
    loaded = load_tensors(store, RUN, manifest)
    return {name: loaded.section(name) for name in manifest.meta.sections}


def test_training_state_round_trips_exactly(ck_store: LocalStorage) -> None:
    model, opt, sched, scaler = _training_objects()
    _train(model, opt, sched, scaler, 5)
    cid = _save(
        ck_store,
        5,
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "lr_scheduler": sched.state_dict(),
            "grad_scaler": scaler.state_dict(),
        },
    )
    state = _load(ck_store, cid)
    m2, o2, s2, g2 = _training_objects(seed=123)
    m2.load_state_dict(state["model"])  # type: ignore[arg-type]
    o2.load_state_dict(state["optimizer"])
    s2.load_state_dict(state["lr_scheduler"])
    g2.load_state_dict(state["grad_scaler"])
    assert g2.state_dict() == scaler.state_dict()
    assert s2.state_dict() == sched.state_dict()
    sd1, sd2 = opt.state_dict(), o2.state_dict()
    assert sd1["param_groups"] == sd2["param_groups"]
    for idx, st in sd1["state"].items():
        for k, v in st.items():
            assert torch.equal(v, sd2["state"][idx][k]), (idx, k)
    # and training continues identically
    torch.manual_seed(7)
    a = _train(model, opt, sched, scaler, 4)
    torch.manual_seed(7)
    b = _train(m2, o2, s2, g2, 4)
    assert a == b


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        torch.tensor([True, False, True]),
        torch.tensor(3.5),  # 0-dim
        torch.empty(0, 3),
        torch.arange(-5, 5, dtype=torch.int64),
        torch.randn(700, 3, dtype=torch.float64),  # > chunk size, shuffled by 8
        torch.randn(2, 2, dtype=torch.complex64),
        torch.randn(64, 33).to(torch.float16),
    ],
    ids=lambda t: f"{t.dtype}-{list(t.shape)}",
)
def test_dtypes_and_shapes_round_trip(ck_store: LocalStorage, tensor: torch.Tensor) -> None:
    cid = _save(
        ck_store,
        1,
        {"x": {"t": tensor}},
        codec="zstd",
        level=3,
        byte_shuffle=True,
        min_size_bytes=0,
    )
    got = _load(ck_store, cid)["x"]
    assert isinstance(got, dict)
    t = got["t"]
    assert t.dtype == tensor.dtype and t.shape == tensor.shape
    assert bytes(raw_bytes(t.contiguous())) == bytes(raw_bytes(tensor.contiguous()))


def test_numpy_values_and_dtypes_in_state(ck_store: LocalStorage) -> None:
    value: dict[str, Any] = {
        "arr": np.arange(10, dtype=np.uint32),
        "scalar": np.float32(1.25),
        "i": np.int64(-3),
        "dtype": torch.bfloat16,
        "plain": [1, "a", None, (2.5, True)],
    }
    cid = _save(ck_store, 1, {"data": value})
    got = _load(ck_store, cid)["data"]
    assert isinstance(got, dict)
    assert isinstance(got["arr"], np.ndarray) and got["arr"].dtype == np.uint32
    assert np.array_equal(got["arr"], value["arr"])
    assert type(got["scalar"]) is np.float32 and got["scalar"] == np.float32(1.25)
    assert type(got["i"]) is np.int64
    assert got["dtype"] is torch.bfloat16
    assert got["plain"] == value["plain"]


def test_flatten_references_live_tensors_without_copying() -> None:
    t = torch.zeros(3)
    live: dict[str, LiveArray] = {}
    tree = flatten({"a": t, "b": [t]}, "s", live)
    assert live["s/a"].value is t
    assert set(jsontree.walk_refs(tree)) == {"s/a", "s/b/0"}


def test_rng_states_round_trip_exactly() -> None:
    random.seed(1)
    random.gauss(0, 1)  # leaves gauss_next set
    np.random.seed(2)
    np.random.standard_normal()  # leaves numpy's cached gaussian set
    torch.manual_seed(3)
    state = capture_rng()
    import json

    tree = jsontree.encode(
        state, lambda v, p: {"__tensor__": "t"} if isinstance(v, torch.Tensor) else None
    )
    json.dumps(tree, allow_nan=False)  # everything but the torch state is plain JSON
    expect = (
        random.random(),
        random.gauss(0, 1),
        np.random.standard_normal(),
        np.random.rand(),
        torch.rand(3),
    )
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng(state)
    got = (
        random.random(),
        random.gauss(0, 1),
        np.random.standard_normal(),
        np.random.rand(),
        torch.rand(3),
    )
    assert got[:4] == expect[:4]
    assert torch.equal(got[4], expect[4])


def test_rng_state_through_a_checkpoint(ck_store: LocalStorage) -> None:
    torch.manual_seed(5)
    state = capture_rng()
    cid = _save(ck_store, 1, {"rng": state})
    expect = torch.rand(4)
    torch.manual_seed(0)
    loaded = _load(ck_store, cid)["rng"]
    assert isinstance(loaded, dict)
    restore_rng(loaded)
    assert torch.equal(torch.rand(4), expect)


def test_hash_mismatch_is_never_loaded(ck_store: LocalStorage) -> None:
    cid = _save(ck_store, 1, {"model": {"w": torch.randn(5000)}}, codec="none", min_size_bytes=0)
    _, manifest = read_checkpoint(ck_store, RUN, cid)
    digest = manifest.tensors["model/w"].chunks[0]
    path = ck_store.root / blob_key(RUN, digest)
    data = bytearray(path.read_bytes())
    data[5] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="corrupted bytes"):
        load_tensors(ck_store, RUN, manifest)


@pytest.mark.parametrize("codec", ["none", "zstd"])
@pytest.mark.parametrize("workers", [1, 3])
def test_multi_chunk_tensors_of_every_width_load_bit_exact(
    ck_store: LocalStorage, codec: str, workers: int
) -> None:
    torch.manual_seed(3)
    tensors = {
        "bf16": torch.randn(5000).to(torch.bfloat16),  # 10 chunks of 1024 bytes (last partial)
        "f16": torch.randn(77, 61).half(),
        "f64": torch.randn(1100, dtype=torch.float64),
        "i64": torch.randint(-(1 << 50), 1 << 50, (1200,)),
        "flag": torch.rand(9001) > 0.5,
        "small": torch.randn(10),  # inline
        "empty": torch.zeros(0, 4),
    }
    cid = _save(ck_store, 1, {"model": tensors}, codec=codec, min_size_bytes=0)
    _, manifest = read_checkpoint(ck_store, RUN, cid)
    assert len(manifest.tensors["model/bf16"].chunks) == 10
    loaded = load_tensors(ck_store, RUN, manifest, workers=workers).section("model")
    assert isinstance(loaded, dict)
    for k, v in tensors.items():
        got = loaded[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


# --------------------------------------------------------------------------- malicious files


class _Boom:
    """Unpickling this writes a sentinel file (what an attacker's payload would do)."""

    sentinel = ""

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.sentinel!r}, 'w').write('pwned')",))


def _pickle_payload(sentinel: Path) -> bytes:
    _Boom.sentinel = str(sentinel)
    return pickle.dumps(_Boom())


def test_pickle_payload_where_a_tensor_should_be_cannot_execute(
    ck_store: LocalStorage, tmp_path: Path
) -> None:
    sentinel = tmp_path / "pwned"
    payload = _pickle_payload(sentinel)
    payload += b"\x00" * (-len(payload) % 4)
    n = len(payload) // 4
    # An attacker controls the whole file set: a blob with a pickle, hashes that match it.
    w = CheckpointWriter(ck_store, RUN, codec=CodecPolicy("none"), inline_max_bytes=0)
    meta = CheckpointMeta(run_id=RUN, step=1, tier=Tier.PULSE, sections=("model",))
    src = TensorSource("model/w", "float32", (n,), memoryview(payload))
    w.commit(meta, [w.write_rank(meta, 0, {"model": {"w": {"__tensor__": "model/w"}}}, [src])])
    cid = checkpoint_id(Tier.PULSE, 1)
    # loading and validating treat it as numbers and nothing else
    state = _load(ck_store, cid)
    assert isinstance(state["model"], dict) and state["model"]["w"].shape == (n,)
    assert load_check(ck_store, RUN, cid).ok
    # a torch.save file (a zip of pickles) in place of a blob: same story
    blob = ck_store.root / blob_key(RUN, sha256_hex(payload))
    assert blob.read_bytes() == payload
    assert not sentinel.exists()


@pytest.mark.parametrize(
    "patch",
    [
        (b'"codec":"none"', b'"codec":"pickle"'),
        (b'"dtype":"float32"', b'"dtype":"object"'),
        (b'{"__tensor__":"model/w"}', b'{"__reduce__":"os.system"}'),
    ],
    ids=["codec", "dtype", "tag"],
)
def test_crafted_manifests_are_refused_or_inert(
    ck_store: LocalStorage, tmp_path: Path, patch: tuple[bytes, bytes]
) -> None:
    cid = _save(ck_store, 1, {"model": {"w": torch.randn(5000)}}, codec="none", min_size_bytes=0)
    key = rank_manifest_key(RUN, cid, 0)
    evil = ck_store.read(key).replace(*patch)
    assert evil != ck_store.read(key)
    from ckpt_agent.format.manifest import RankManifest

    try:
        m = RankManifest.from_bytes(evil)
    except CheckpointFormatError as e:
        assert "pickle" in str(e) or "object" in str(e)
        return
    # an unknown tag is just a dict with a funny key: it is data, never called
    loaded = load_tensors(ck_store, RUN, m)
    assert loaded.section("model") == {"w": {"__reduce__": "os.system"}}
