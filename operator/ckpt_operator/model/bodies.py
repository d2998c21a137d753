"""Typed views over Kubernetes objects (the shape of kopf's ``_cogs/structs/bodies.py``).

An object from the API, a watch, a cache or an admission review is a JSON mapping whose
every level may be missing (``metadata`` of a pod template, ``labels`` of a bare object,
``status`` of a new one). The views read it in one place: ``Body(pod).meta.namespace``,
``.meta.annotations``, ``.spec``, ``.status``; a missing level reads as empty, a missing
scalar as ``None``. They copy nothing and never write: ``.raw`` is the mapping itself
(for building a changed copy); as in kopf, a view is also a read-only mapping of its raw
keys, for the rare key no property names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["Body", "Meta", "RawBody", "continue_token", "meta_of"]

#: An object as the API returns it (JSON: a mapping of mappings).
RawBody = Mapping[str, Any]

_EMPTY: Mapping[str, Any] = {}


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


class _View(Mapping[str, Any]):
    __slots__ = ("raw",)

    def __init__(self, raw: Mapping[str, Any] | None) -> None:
        self.raw: Mapping[str, Any] = raw or _EMPTY

    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)


class Meta(_View):
    """``metadata`` of an object (ObjectMeta): every field optional, maps never None."""

    __slots__ = ()

    @property
    def name(self) -> str | None:
        return _opt_str(self.raw.get("name"))

    @property
    def namespace(self) -> str | None:
        return _opt_str(self.raw.get("namespace"))

    @property
    def uid(self) -> str | None:
        return _opt_str(self.raw.get("uid"))

    @property
    def resource_version(self) -> str | None:
        return _opt_str(self.raw.get("resourceVersion"))

    @property
    def generation(self) -> Any:
        """As stored (an int from the API server; written back unchanged)."""
        return self.raw.get("generation")

    @property
    def creation_timestamp(self) -> str | None:
        return _opt_str(self.raw.get("creationTimestamp"))

    @property
    def deletion_timestamp(self) -> str | None:
        return _opt_str(self.raw.get("deletionTimestamp"))

    @property
    def labels(self) -> Mapping[str, str]:
        labels: Mapping[str, str] = self.raw.get("labels") or _EMPTY
        return labels

    @property
    def annotations(self) -> Mapping[str, str]:
        annotations: Mapping[str, str] = self.raw.get("annotations") or _EMPTY
        return annotations

    @property
    def owner_references(self) -> Sequence[Mapping[str, Any]]:
        refs: Sequence[Mapping[str, Any]] = self.raw.get("ownerReferences") or ()
        return refs


class Body(_View):
    """An object (or a pod template: ``metadata`` + ``spec``) read through :class:`Meta`."""

    __slots__ = ("meta",)

    def __init__(self, raw: Mapping[str, Any] | None) -> None:
        super().__init__(raw)
        self.meta = Meta(self.raw.get("metadata"))

    @property
    def spec(self) -> Mapping[str, Any]:
        spec: Mapping[str, Any] = self.raw.get("spec") or _EMPTY
        return spec

    @property
    def status(self) -> Mapping[str, Any]:
        status: Mapping[str, Any] = self.raw.get("status") or _EMPTY
        return status


def meta_of(obj: Mapping[str, Any] | None) -> Meta:
    """``Body(obj).meta`` without the body: the one view most readers need."""
    return Meta((obj or _EMPTY).get("metadata"))


def continue_token(page: Mapping[str, Any]) -> str | None:
    """A list page's ``metadata.continue`` (ListMeta): the next page's token, or None."""
    token = (page.get("metadata") or _EMPTY).get("continue")
    return str(token) if token else None
