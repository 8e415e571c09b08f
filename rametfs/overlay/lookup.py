"""Reading the merged namespace: lookup, the merged listing (base names minus whiteouts plus
upper names), attributes, symlink targets and extended attributes.

A name of an execution's directory is found in the layer's dentries first (an added name, or
a whiteout), then in the directory's base tree; a base entry gets a node, and an inode number,
the first time it is looked up or listed.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import stat
from typing import Iterator

from ..errors import InvalidArgument, NotFound, RametError, fs_error
from ..protocol import CONTROL_DIR
from ..store import WHITEOUT, Entry, Store
from ..store.layers import merged_children
from ..treewalk import Steps, preorder, run_steps
from .nodes import Attrs, Execution, InodeTable, Node
from .slices import in_slices
from .trees import BaseTrees

NAME_MAX = 255
RESERVED = CONTROL_DIR.encode()  # the name no entry may have at an execution's root
DIR_SIZE = 4096
LIST_STEP = 1024  # names a listing makes per step (listdir_steps)


def check_name(name: bytes) -> None:
    """Raise ENAMETOOLONG for a name over 255 bytes, EINVAL for one with '/' or NUL."""
    if len(name) > NAME_MAX:
        raise fs_error(errno.ENAMETOOLONG, f"name of {len(name)} bytes, at most {NAME_MAX}")
    if b"/" in name or b"\0" in name or name in (b"", b".", b".."):
        raise InvalidArgument(f"invalid name {name!r}")


class Lookup:
    """Lookup and listing over ``table``'s nodes, the layers' dentries in ``store`` and the
    base ``trees``."""

    def __init__(self, store: Store, table: InodeTable, trees: BaseTrees):
        self.store = store
        self.layers = store.layers
        self.table = table
        self.trees = trees

    def lookup(self, parent_ino: int, name: bytes) -> Node:
        """The node named ``name`` in directory ``parent_ino``; NotFound (ENOENT) if none,
        ENAMETOOLONG for a name over 255 bytes (the kernel leaves that check to FUSE)."""
        if len(name) > NAME_MAX:
            check_name(name)
        parent = self.table.node(parent_ino)
        view = parent.view
        ino = view.dcache.get((parent_ino, name))
        nodes = self.table.nodes
        if ino is not None and ino in nodes:
            return nodes[ino]
        if not parent.is_dir:
            raise fs_error(errno.ENOTDIR)
        if isinstance(view, Execution) and parent.upper is not None:
            with self.store.read() as txn:
                ino = self.layers.dentry(txn, view.layer, parent_ino, name)
            if ino is not None:
                if ino == WHITEOUT:
                    raise NotFound(f"{name!r} was deleted")
                return self._load_upper(view, ino, parent_ino, name)
        tree = parent.tree
        entry = self.trees.tree(tree).get(name) if tree is not None else None
        if entry is None:
            raise NotFound(f"no {name!r}")
        return self._base_child(parent, name, entry)

    def _base_child(self, parent: Node, name: bytes, entry: Entry) -> Node:
        """The node of base entry ``entry`` named ``name`` in ``parent`` (no upper dentry).

        The names of one base hard-link group share one node (and inode number).
        """
        view = parent.view
        nodes = self.table.nodes
        if entry.link:
            ino = view.link_inos.get(entry.link)
            if ino is not None and ino in nodes:
                view.dcache[(parent.ino, name)] = ino
                return nodes[ino]
            if isinstance(view, Execution):
                with self.store.read() as txn:
                    ino = self.layers.link(txn, view.layer, entry.link)
                if ino is not None:
                    return self._load_upper(view, ino, parent.ino, name)
        node = self.table.add(Node(self.table.alloc_ino(), view, entry, None, parent.ino, name))
        if entry.link:
            view.link_inos[entry.link] = node.ino
        return node

    def _load_upper(self, ex: Execution, ino: int, parent: int, name: bytes) -> Node:
        """The node of upper inode ``ino`` of ``ex``, named ``name`` in ``parent``, its
        record read from the layer when it has no node yet; EIO when it has none."""
        node = self.table.nodes.get(ino)
        if node is None:
            with self.store.read() as txn:
                stored = self.layers.inode(txn, ex.layer, ino)
            if stored is None:
                raise RametError(errno.EIO,
                                 f"execution {ex.id}: dentry {name!r} names missing inode {ino}")
            upper, node_bytes = stored
            node = Node(ino, ex, upper.base, upper, parent, name)
            node.record_bytes = node_bytes
            if upper.base is not None and upper.base.link:
                ex.link_inos[upper.base.link] = ino
        elif node.is_dir:
            node.parent, node.name = parent, name
        self.table.nodes[ino] = node
        ex.inos.add(ino)
        ex.dcache[(parent, name)] = ino
        return node

    async def prefetch(self, ino: int) -> None:
        """Make sure directory ``ino``'s base tree is decoded before a lookup or listing
        needs it, a large one in a worker thread of its view's (``BaseTrees.prefetch``)."""
        node = self.table.nodes.get(ino)
        tid = node.tree if node is not None and node.is_dir else None
        if tid is not None:
            await self.trees.prefetch(tid, node.view.threads)

    def listdir(self, dir_ino: int) -> list[tuple[bytes, Node]]:
        """The merged listing of a directory (base names minus whiteouts plus upper names),
        sorted by name."""
        return run_steps(self.listdir_steps(dir_ino))

    async def listdir_in_slices(self, dir_ino: int) -> list[tuple[bytes, Node]]:
        """:meth:`listdir` in slices of the trio thread (``in_slices``), its execution
        frozen meanwhile: a directory of a million names delays other requests by a slice."""
        view = self.table.node(dir_ino).view
        await self.prefetch(dir_ino)
        with view.freeze() if isinstance(view, Execution) else contextlib.nullcontext():
            return await in_slices(self.listdir_steps(dir_ino))

    def listdir_steps(self, dir_ino: int) -> Steps[list[tuple[bytes, Node]]]:
        """:meth:`listdir` as steps, one per :data:`LIST_STEP` names; ESTALE when a reset
        or release drops the directory's layer meanwhile."""
        d = self.table.node(dir_ino)
        if not d.is_dir:
            raise fs_error(errno.ENOTDIR)
        base = (yield from self.trees.tree_steps(d.tree)) if d.tree is not None else {}
        upper: dict[bytes, int] = {}  # upper names in name order (the keys'): ino or WHITEOUT
        view = d.view
        if isinstance(view, Execution) and d.upper is not None:
            after = None
            while True:  # a read transaction per batch: none is held across a step
                with self.store.read() as txn:
                    batch = list(itertools.islice(
                        self.layers.dentries(txn, view.layer, dir_ino, after), LIST_STEP))
                upper.update(batch)
                if len(batch) < LIST_STEP:
                    break
                after = batch[-1][0]  # the next batch starts after the last name read
                yield
                self.table.check_live(d)
        # A base stored before the name was reserved may hold it: never listed.
        hidden = RESERVED if isinstance(view, Execution) and dir_ino == view.root_ino else None
        out = []
        for i, (name, item) in enumerate(merged_children(base, upper), 1):
            if i % LIST_STEP == 0:
                yield
                self.table.check_live(d)
            if item is None or name == hidden:  # a whiteout, or the reserved name
                continue
            ino = view.dcache.get((dir_ino, name))
            node = self.table.nodes.get(ino) if ino is not None else None
            if node is None:
                if isinstance(item, int):
                    node = self._load_upper(view, item, dir_ino, name)
                else:
                    node = self._base_child(d, name, item)
            out.append((name, node))
        return out

    def is_empty_dir(self, node: Node) -> bool:
        """Whether directory ``node`` holds no name, without listing it (rmdir of a directory
        of 500,000 names listed them all on the trio thread): any upper name that is not a
        whiteout says no at once; else it is empty when every base name is whited out (a
        whiteout is written only for a base name)."""
        base = len(self.trees.tree(node.tree)) if node.tree is not None else 0
        view = node.view
        if not isinstance(view, Execution) or node.upper is None:
            return base == 0
        with self.store.read() as txn:
            return self.layers.whiteouts_only(txn, view.layer, node.ino) == base

    @staticmethod
    def attrs(node: Node, stored: int | None = None) -> Attrs:
        """What stat(2) shows of ``node``; ``stored``: the bytes its data takes where kept
        (FileData.attrs gives them; None: its size)."""
        u = node.upper
        if u is not None:
            return Attrs(node.ino, u.mode, u.nlink, u.uid, u.gid, u.rdev,
                         DIR_SIZE if stat.S_ISDIR(u.mode) else
                         (len(u.target) if stat.S_ISLNK(u.mode) else u.size),
                         u.atime_ns, u.mtime_ns, u.ctime_ns, stored)
        e = node.entry
        if e.is_dir:
            size, rdev = DIR_SIZE, 0
        elif e.is_symlink:
            size, rdev = len(e.ref), 0
        elif e.is_reg:
            size, rdev = e.size, 0
        else:
            size, rdev = 0, e.size
        return Attrs(node.ino, e.mode, e.nlink, e.uid, e.gid, rdev, size,
                     e.mtime_ns, e.mtime_ns, e.mtime_ns, stored)

    @staticmethod
    def readlink(node: Node) -> bytes:
        if not stat.S_ISLNK(node.mode):
            raise InvalidArgument("not a symbolic link")
        return node.upper.target if node.upper else node.entry.ref

    @staticmethod
    def xattrs(node: Node) -> dict[bytes, bytes]:
        return node.upper.xattrs if node.upper else dict(node.entry.xattrs)


def walk_names(overlay, ino: int, prefix: bytes = b"") -> Iterator[tuple[bytes, Node]]:
    """Every path below directory ``ino`` (depth first, sorted), with its node; ``overlay``
    lists directories (:meth:`Lookup.listdir`: a Lookup or the Overlay facade)."""
    def below(item: tuple[bytes, Node]) -> list[tuple[bytes, Node]] | None:
        path, node = item
        return [(path + b"/" + name, child) for name, child in overlay.listdir(node.ino)] \
            if node.is_dir else None

    return preorder([(prefix + name, child) for name, child in overlay.listdir(ino)], below)
