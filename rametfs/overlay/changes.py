"""The change clock of each execution and the tokens of git's fsmonitor hook.

Every change to an execution stamps the inode or the ``(parent, name)`` dentry it changed
with the execution's clock (``Execution.changes``, memory only); a token names a clock value
of one daemon run and layer, and the paths changed after it are found from the stamps.
"""

from __future__ import annotations

import heapq
import secrets
from typing import Callable, Iterable

from .nodes import Execution, InodeTable, Node
from .slices import in_slices
from ..treewalk import Steps

MAX_CHANGES = 1 << 18  # change-clock entries kept per execution (about 150 bytes each)
CHANGES_STEP = 1024  # changes, names of one path, or paths sorted per step of an fsmonitor walk


class _TooLong(Exception):
    """A path of an fsmonitor walk (ChangeClock._path_steps) past the walk's byte limit."""


def changed(ex: Execution, key: int | tuple[int, bytes]) -> None:
    """Stamp inode ``key`` (or dentry ``(parent ino, name)``) of ``ex`` as changed now."""
    ex.clock += 1
    if len(ex.changes) >= MAX_CHANGES and key not in ex.changes:
        # Forget them: a token from before now answers "everything may differ", which
        # git's fsmonitor protocol allows (a full scan), and memory stays bounded.
        ex.changes, ex.changes_floor = {}, ex.clock
    ex.changes[key] = ex.clock


class ChangeClock:
    """What changed in the executions of ``table``'s nodes since a token (:func:`changed`
    stamps the changes)."""

    def __init__(self, table: InodeTable):
        self.table = table
        self.boot = secrets.token_hex(4)  # tells change clocks of two daemon runs apart

    def fsmonitor_token(self, ex: Execution) -> str:
        """An opaque token for "now" in ``ex``, for :meth:`changed_since_steps`."""
        return f"rametfs:{self.boot}:{ex.layer}:{ex.clock}"

    async def changed_since_in_slices(self, ex: Execution, token: str,
                                      shown: Callable[[bytes], bytes | None],
                                      max_bytes: int) -> list[bytes] | None:
        """:meth:`changed_since_steps` in slices of the trio thread (``in_slices``), ``ex``
        frozen meanwhile (one point in time, as a diff)."""
        with ex.freeze():
            return await in_slices(self.changed_since_steps(ex, token, shown, max_bytes))

    def changed_since_steps(self, ex: Execution, token: str,
                            shown: Callable[[bytes], bytes | None], max_bytes: int
                            ) -> Steps[list[bytes] | None]:
        """The files, symlinks and names changed in ``ex`` after ``token`` was given out,
        each path (relative to the execution root) as ``shown`` gives it (None: left out),
        sorted, each once.  None, "everything may have changed", when the token is not one
        of this daemon run and layer (after a restart or a reset, also one during the walk),
        or when one path, or the paths shown with a byte after each, take more than
        ``max_bytes``: no more than that is made.  Steps: one per :data:`CHANGES_STEP`
        changes looked at and per :data:`CHANGES_STEP` names of one path, then the sort's
        (:func:`sorted_steps`)."""
        prefix = f"rametfs:{self.boot}:{ex.layer}:"
        clock = token[len(prefix):]
        if not token.startswith(prefix) or not (clock.isascii() and clock.isdigit()) \
                or len(clock) > 20:  # int() of 4,300 digits or of "²" raises
            return None
        since = int(clock)
        if since < ex.changes_floor:
            return None
        layer = ex.layer
        paths: set[bytes] = set()
        left = max_bytes
        try:
            for i, (key, clock) in enumerate(ex.changes.items(), 1):  # frozen: it stays
                if i % CHANGES_STEP == 0:
                    yield
                    if ex.layer != layer:
                        return None
                if clock <= since:
                    continue
                name = key[1] if isinstance(key, tuple) else None
                node = self.table.nodes.get(key[0] if name is not None else key)
                if node is None or not self.table.is_live(node) or (name is None and node.is_dir):
                    continue
                path = yield from self._path_steps(node, name, max_bytes)
                if ex.layer != layer:
                    return None
                item = shown(path) if path is not None else None
                if item is not None and item not in paths:
                    left -= len(item) + 1
                    if left < 0:
                        return None
                    paths.add(item)
        except _TooLong:
            return None
        return (yield from sorted_steps(paths))

    def _path_steps(self, node: Node, name: bytes | None, max_bytes: int
                    ) -> Steps[bytes | None]:
        """The path of ``node`` (with ``name`` in it, if given) relative to its view's root,
        by its parents; None when a parent is gone (an unlinked directory forgotten);
        :class:`_TooLong` past ``max_bytes``.  One step per :data:`CHANGES_STEP` names."""
        parts = [] if name is None else [name]
        size = 0 if name is None else len(name)
        while node.ino != node.view.root_ino:
            if not node.name:  # a tmpfile not linked yet: no path (its link stamps one)
                return None
            parts.append(node.name)
            size += len(node.name) + 1
            if size > max_bytes:
                raise _TooLong
            node = self.table.nodes.get(node.parent)
            if node is None or not self.table.is_live(node):
                return None
            if len(parts) % CHANGES_STEP == 0:
                yield
        return b"/".join(reversed(parts))


def sorted_steps(items: Iterable[bytes]) -> Steps[list[bytes]]:
    """``sorted(items)`` as steps: runs of :data:`CHANGES_STEP` items sorted one per step,
    then merged (heapq.merge), a step per :data:`CHANGES_STEP` items, so that sorting a
    million paths delays other requests by a slice, not by the sort."""
    items = list(items)
    runs = []
    for i in range(0, len(items), CHANGES_STEP):
        runs.append(sorted(items[i:i + CHANGES_STEP]))
        yield
    del items
    out = []
    for i, item in enumerate(heapq.merge(*runs), 1):
        out.append(item)
        if i % CHANGES_STEP == 0:
            yield
    return out
