"""The interface's default :meth:`Storage.create_exclusive` and :meth:`Storage.delete_many`
(what an in-process store, such as the tests' memory store, inherits)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ckpt_agent.errors import PermanentStorageError, RetryableStorageError
from tests.ckpt_agent.runtime.runtime_fakes import MemoryStorage


def test_default_create_exclusive_has_one_winner_and_never_replaces() -> None:
    store = MemoryStorage()
    assert not store.atomic_create  # only among this process's users
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda i: store.create_exclusive("k", f"w{i}".encode()), range(8)))
    assert sum(won) == 1
    assert store.read("k") == f"w{won.index(True)}".encode()
    assert store.create_exclusive("k", store.read("k"))  # the same bytes: ours
    assert not store.create_exclusive("k", b"other")


class _Failing(MemoryStorage):
    def delete(self, key: str) -> None:
        if key == "bad":
            raise PermanentStorageError("no")
        if key == "busy":
            raise RetryableStorageError("later")
        super().delete(key)


def test_default_delete_many_tries_every_key_then_names_the_failures() -> None:
    store = _Failing()
    for k in ("a", "b", "bad"):
        store.commit(k, b"1")
    with pytest.raises(PermanentStorageError, match=r"1 of 4 key\(s\) not deleted: bad: no"):
        store.delete_many(["a", "bad", "b", "missing"])
    assert sorted(store.objects) == ["bad"]
    with pytest.raises(RetryableStorageError, match="try again later"):
        store.delete_many(["busy"])
