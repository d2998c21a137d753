"""A filesystem store that never leaves a grant.

The operator opens a tenant's ``local.path`` only below a folder an administrator
granted to the tenant's namespace. Checking the path *as written* is not enough: a
symbolic link inside the grant (``<grant>/escape -> /other-team``) would pass, and the
storage would then follow it. So the operator resolves the path and checks where it
leads (:func:`ckpt_operator.adapters.sources.resolve_path`,
:func:`ckpt_operator.planners.tenancy.resolved_refusal`), and then opens it as

* :class:`AnchoredLocalStorage`: :class:`~ckpt_agent.storage.fs.LocalStorage` rooted
  at that resolved path whose root is opened, on every call, from the grant (the
  ``anchor``) one folder at a time with ``O_NOFOLLOW``
  (:class:`~ckpt_agent.storage.confined.ConfinedTree`): a link swapped into the path
  after the check is refused (:class:`~ckpt_agent.errors.UnsafePathError`) at the next
  open instead of being followed. The check and the use cannot disagree.

The anchor itself (the granted folder, resolved) and the folders above it are the
administrator's: trusted, opened by path.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckpt_agent.errors import NotFoundError, StorageError, UnsafePathError
from ckpt_agent.storage.confined import ConfinedTree
from ckpt_agent.storage.fs import LocalStorage
from ckpt_agent.storage.options import StorageOptions

__all__ = ["AnchoredLocalStorage"]


class AnchoredLocalStorage(LocalStorage):
    """:class:`LocalStorage` at ``root`` (already resolved) whose root
    is opened from ``anchor`` (a resolved folder at or above it) without following links.

    :class:`UnsafePathError` when ``root`` is not below ``anchor`` or no longer resolves to
    itself (a link was swapped in since it was resolved).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        anchor: str | os.PathLike[str],
        options: StorageOptions | None = None,
    ) -> None:
        super().__init__(root, options)
        given = Path(os.path.abspath(os.fspath(root)))
        self.anchor = Path(os.path.abspath(os.fspath(anchor)))
        if self.root != given:
            raise UnsafePathError(
                f"storage root {str(given)!r} now resolves to {str(self.root)!r}: a symbolic "
                "link was put on the way after the path was checked; it is not followed. "
                "Whoever can write the volume put it there: remove it."
            )
        if not self.root.is_relative_to(self.anchor):
            raise UnsafePathError(f"storage root {str(self.root)!r} is not below {self.anchor}")
        self._tree = ConfinedTree(self.root, anchor=self.anchor)

    def __repr__(self) -> str:
        return f"AnchoredLocalStorage({str(self.root)!r}, anchor={str(self.anchor)!r})"

    def reachable(self) -> bool:
        """Whether the root exists (reached from the anchor, never through a link; a link
        on the way counts as reachable: the next call refuses it with
        :class:`UnsafePathError`)."""
        try:
            fd = self._tree.open_root()
        except NotFoundError:
            return False
        except StorageError:
            return True
        os.close(fd)
        return True
