"""Namespace changes: create, mkdir, mknod, symlink, link, unlink, rmdir and rename, and the
files of no name that open(2) with O_TMPFILE makes (a link may name one).

Each change stores its dentries (an added name, or a whiteout for a base name removed) and
every record it changed in one transaction, so a crash keeps all of it or none; when that
transaction fails (a full disk), what the change did in memory is put back.  Directories from
the base move for real within an execution; a rename or link between two views is EXDEV.
A new node in a directory with a default POSIX ACL inherits from it, else the caller's umask
applies (:meth:`Names._initial`, rametfs.core.acl).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import operator
import stat
import time
from typing import Iterator

from ..core import acl
from ..errors import InvalidArgument, NotFound, RametError, fs_error
from ..protocol import CONTROL_DIR
from ..store import WHITEOUT, Store
from ..store.format import UpperInode
from ..store.layers import dentry_bytes
from ..treewalk import Steps, run_steps
from .changes import changed
from .lookup import RESERVED, Lookup, check_name
from .nodes import Execution, InodeTable, Node
from .slices import in_slices
from .trees import BaseTrees
from .upper import Upper

ANCESTOR_STEP = 1024  # parents a directory move's check looks at per step (about 1 ms)
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4  # renameat2(2) flags


def check_not_reserved(ex: Execution, parent: Node, name: bytes) -> None:
    """EEXIST for the name the control directory has at an execution's root: a file there
    would hide ``.ramet`` (and land in a snapshot, where it hides it from every execution
    of it)."""
    if parent.ino == ex.root_ino and name == RESERVED:
        raise RametError(errno.EEXIST, f"{CONTROL_DIR} is reserved for rametfs control files")


# An upper record's fields as a tuple, in UpperInode.__slots__ order: a shallow copy for
# Names._undone_on_failure, at a tenth of copy.copy's cost (0.2 against 2.3 µs).
_record_fields = operator.attrgetter(*UpperInode.__slots__)


class Names:
    """The namespace changes of the views of ``table``: names found by ``lookups`` in the
    base ``trees`` and the layers' dentries in ``store``, records copied up and stored by
    ``upper``."""

    def __init__(self, store: Store, table: InodeTable, trees: BaseTrees, lookups: Lookup,
                 upper: Upper):
        self.store = store
        self.table = table
        self.trees = trees
        self.lookups = lookups
        self.upper = upper

    def _store_names(self, names: list[tuple[Node, bytes, Node | None]], *also: Node,
                     adopted: Node | None = None) -> None:
        """One namespace change, in one transaction: each ``(parent, name, child)`` names
        ``child`` in ``parent`` (None removes the name: a whiteout when the base has it) and
        sets the parent's mtime; the records of the parents, the children and ``also`` are
        stored with the dentries, and ``adopted``, an orphan given its first name (a
        tmpfile), loses its orphan mark, so a crash keeps all of it or none."""
        nodes: dict[int, Node] = {}
        for parent, name, child in names:  # the parents are in one execution (rename checks)
            ex = self.upper.writable(parent)
            changed(ex, (parent.ino, name))
            self.upper.copy_up(parent)
            self.upper.touch(parent)
            nodes[parent.ino] = parent
            if child is not None:
                nodes[child.ino] = child
        nodes.update((n.ino, n) for n in also)
        if all(child is not None for _, _, child in names):  # only adds names: room for them
            self.upper.check_room(ex, 1)
        layers = self.store.layers
        added = 0  # bytes of dentries, whiteouts included
        with self.store.write() as txn:
            for parent, name, child in names:
                if layers.dentry(txn, ex.layer, parent.ino, name) is not None:
                    added -= dentry_bytes(name)
                if child is not None:
                    layers.put_dentry(txn, ex.layer, parent.ino, name, child.ino)
                elif parent.tree is not None and name in self.trees.tree(parent.tree):
                    layers.put_dentry(txn, ex.layer, parent.ino, name, WHITEOUT)
                else:
                    layers.delete_dentry(txn, ex.layer, parent.ino, name)
                    continue
                added += dentry_bytes(name)
            if adopted is not None:
                layers.delete_orphan(txn, ex.layer, adopted.ino)
            self.upper.put_records(txn, nodes.values())
        self.upper.stored(nodes.values())
        ex.upper_bytes += added
        for parent, name, child in names:
            if child is None:
                ex.dcache.pop((parent.ino, name), None)
            else:
                ex.dcache[(parent.ino, name)] = child.ino
                ex.inos.add(child.ino)

    def _new_node(self, parent: Node, name: bytes, mode: int, uid: int, gid: int,
                  umask: int = 0, **fields) -> Node:
        """A new inode named ``name`` in ``parent``, of ``mode`` as the caller asked for it,
        its ACLs and umask applied (:meth:`_initial`); EEXIST if the name is taken.  A new
        directory (``mode`` S_IFDIR) adds a link to ``parent``."""
        ex = self.upper.writable(parent)
        check_name(name)
        check_not_reserved(ex, parent, name)
        try:
            self.lookups.lookup(parent.ino, name)
        except NotFound:
            pass
        else:
            raise fs_error(errno.EEXIST, f"{name!r} exists")
        mode, xattrs = self._initial(parent, mode, umask)
        node = self._unstored_node(parent, name, mode, uid, gid, xattrs=xattrs, **fields)
        with self._undone_on_failure(parent):
            if stat.S_ISDIR(mode):
                parent.upper.nlink += 1
            self._store_names([(parent, name, node)])
        ex.upper_inodes += 1
        self.table.nodes[node.ino] = node
        return node

    def _initial(self, parent: Node, mode: int, umask: int) -> tuple[int, dict[bytes, bytes]]:
        """The mode and xattrs of a new node of ``mode`` in ``parent``, as
        ``posix_acl_create`` makes them on ext4: where ``parent`` has a default ACL, the
        access ACL it gives (``acl.inherit``) and, for a directory, the default ACL too, and
        no umask; elsewhere ``mode`` less ``umask`` (permission bits).  A symlink's is
        neither.  EIO when the default ACL stored is malformed (none that passed
        ``setxattr``)."""
        if stat.S_ISLNK(mode):
            return mode, {}
        default = self.lookups.xattrs(parent).get(acl.DEFAULT)
        if default is None:
            return mode & ~(umask & 0o777), {}
        try:
            entries = acl.decode(default)
        except RametError as exc:
            raise RametError(errno.EIO, f"the directory's default ACL: {exc}") from None
        mode, access = acl.inherit(entries, mode)
        xattrs = {} if access is None else {acl.ACCESS: acl.encode(access)}
        if stat.S_ISDIR(mode):
            xattrs[acl.DEFAULT] = default
        return mode, xattrs

    def _unstored_node(self, parent: Node, name: bytes, mode: int, uid: int, gid: int,
                       **fields) -> Node:
        """A new inode for the name ``name`` in ``parent`` (in an execution), its times now,
        the group (and a directory's set-group-ID bit) of a set-group-ID ``parent``; the
        caller stores its name.  EDQUOT past the execution's inode limit."""
        if parent.mode & stat.S_ISGID:
            gid = parent.upper.gid if parent.upper else parent.entry.gid
            if stat.S_ISDIR(mode):
                mode |= stat.S_ISGID
        now = time.time_ns()
        upper = UpperInode(mode=mode, uid=uid, gid=gid, atime_ns=now, mtime_ns=now,
                           ctime_ns=now, **fields)
        self.upper.check_inode_quota(parent.view)
        return Node(self.table.alloc_ino(), parent.view, None, upper, parent.ino, name)

    def mkdir(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int,
              umask: int = 0) -> Node:
        return self._new_node(self.table.node(parent_ino), name, stat.S_IFDIR | (mode & 0o7777),
                              uid, gid, umask, nlink=2)

    def mknod(self, parent_ino: int, name: bytes, mode: int, rdev: int, uid: int, gid: int,
              umask: int = 0) -> Node:
        return self._new_node(self.table.node(parent_ino), name, mode, uid, gid, umask,
                              rdev=rdev)

    def create(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int,
               umask: int = 0) -> Node:
        return self._new_node(self.table.node(parent_ino), name, stat.S_IFREG | (mode & 0o7777),
                              uid, gid, umask)

    def tmpfile(self, parent_ino: int, mode: int, uid: int, gid: int, linkable: bool,
                umask: int = 0) -> Node:
        """open(2) with O_TMPFILE in directory ``parent_ino``: a new regular file of no name
        (nlink 0), its ACLs and umask applied as a create's (:meth:`_initial`), its record
        stored with an orphan mark, so that it goes when the kernel forgets it
        (``Reclaimer.forgotten``) or, after a crash, at the next start.  It counts against
        the execution's limits while it lives (EDQUOT).  ``linkable`` (opened without
        O_EXCL): :meth:`link` may give it a name."""
        parent = self.table.node(parent_ino)
        ex = self.upper.writable(parent)
        mode, xattrs = self._initial(parent, stat.S_IFREG | (mode & 0o7777), umask)
        node = self._unstored_node(parent, b"", mode, uid, gid, nlink=0, xattrs=xattrs)
        self.upper.check_room(ex, 1)
        self.upper.save(node)
        ex.upper_inodes += 1
        self.table.nodes[node.ino] = node
        ex.inos.add(node.ino)
        if linkable:
            ex.linkable.add(node.ino)
        return node

    def symlink(self, parent_ino: int, name: bytes, target: bytes, uid: int, gid: int) -> Node:
        return self._new_node(self.table.node(parent_ino), name, stat.S_IFLNK | 0o777, uid, gid,
                              target=target)

    def link(self, ino: int, parent_ino: int, name: bytes) -> Node:
        """link(2); EXDEV from another view (each snapshot and execution is its own tree).
        An inode of no name takes one only if it is a tmpfile opened without O_EXCL, and
        once (ENOENT otherwise, as Linux answers): the name becomes its own."""
        node = self.table.node(ino)
        parent = self.table.node(parent_ino)
        if node.view is not parent.view:
            raise fs_error(errno.EXDEV, "a hard link cannot cross snapshots and executions")
        ex = self.upper.writable(parent)
        check_name(name)
        check_not_reserved(ex, parent, name)
        if node.is_dir:
            raise fs_error(errno.EPERM, "hard links to directories are not allowed")
        try:
            self.lookups.lookup(parent_ino, name)
        except NotFound:
            pass
        else:
            raise fs_error(errno.EEXIST, f"{name!r} exists")
        unnamed = node.upper is not None and node.upper.nlink == 0
        if unnamed and node.ino not in ex.linkable:
            raise fs_error(errno.ENOENT, "an inode whose last name went, or a tmpfile opened "
                                         "with O_EXCL, cannot be linked")
        with self._undone_on_failure(parent, node):
            node.upper.nlink += 1
            self.upper.touch(node, mtime=False)
            if unnamed:
                node.parent, node.name = parent.ino, name
            self._store_names([(parent, name, node)], adopted=node if unnamed else None)
        ex.linkable.discard(node.ino)
        return node

    @contextlib.contextmanager
    def _undone_on_failure(self, *nodes: Node | None) -> Iterator[None]:
        """Copy ``nodes`` up, then put their records and names back as they were if the block
        raises.  A namespace change changes them in memory before the transaction that stores
        them; when that fails (a full disk) nothing changed on disk, and a file left named
        with a link count of 0 would be deleted once the kernel forgets it."""
        saved = [(n, _record_fields(self.upper.copy_up(n)), n.parent, n.name)
                 for n in nodes if n is not None]
        try:
            yield
        except BaseException:
            for node, fields, parent, name in saved:
                for field_name, value in zip(UpperInode.__slots__, fields):
                    setattr(node.upper, field_name, value)
                node.parent, node.name = parent, name
            raise

    def _count_link_down(self, parent: Node, node: Node) -> None:
        """``node`` loses its name in ``parent``: its link count (and a directory's parent's)
        goes down, in memory; the caller stores both with the dentry change.

        The inode is copied up first: one still open keeps its attributes (nlink 0) and
        stays readable and writable until the kernel forgets it (``Reclaimer.forgotten``).
        """
        u = self.upper.copy_up(node)
        if node.is_dir:
            self.upper.copy_up(parent).nlink -= 1
            u.nlink = 0
        else:
            u.nlink -= 1
            self.upper.touch(node, mtime=False)

    def unlink(self, parent_ino: int, name: bytes) -> None:
        parent = self.table.node(parent_ino)
        self.upper.writable(parent)
        node = self.lookups.lookup(parent_ino, name)
        if node.is_dir:
            raise fs_error(errno.EISDIR)
        with self._undone_on_failure(parent, node):
            self._count_link_down(parent, node)
            self._store_names([(parent, name, None)], node)

    def rmdir(self, parent_ino: int, name: bytes) -> None:
        parent = self.table.node(parent_ino)
        self.upper.writable(parent)
        node = self.lookups.lookup(parent_ino, name)
        if not node.is_dir:
            raise fs_error(errno.ENOTDIR)
        if not self.lookups.is_empty_dir(node):
            raise fs_error(errno.ENOTEMPTY)
        with self._undone_on_failure(parent, node):
            self._count_link_down(parent, node)
            self._store_names([(parent, name, None)], node)

    @staticmethod
    def _moves_of_directories(src: Node, dst: Node | None, old_parent: Node,
                              new_parent: Node) -> list[tuple[Node, Node]]:
        """The ``(directory, new parent)`` pairs of a rename (``dst``: the other side of an
        exchange) that must not put a directory below itself: none within one directory."""
        if old_parent.ino == new_parent.ino:
            return []
        return [(d, p) for d, p in ((src, new_parent), (dst, old_parent))
                if d is not None and d.is_dir]

    def _not_below_steps(self, ex: Execution, directory: Node, parent: Node) -> Steps[None]:
        """InvalidArgument (EINVAL) when ``parent`` is ``directory`` or below it, walking
        ``parent``'s ancestors; a step per :data:`ANCESTOR_STEP` of them (a tree may be any
        depth)."""
        p = parent
        for i in itertools.count(1):
            if p.ino == directory.ino:
                raise InvalidArgument("cannot move a directory into itself")
            if p.ino == ex.root_ino:
                return
            if i % ANCESTOR_STEP == 0:
                yield
            p = self.table.node(p.parent)

    async def rename_in_slices(self, old_parent_ino: int, old_name: bytes,
                               new_parent_ino: int, new_name: bytes, flags: int,
                               owner: tuple[int, int] = (0, 0)) -> None:
        """:meth:`rename`, its check that no directory moves below itself made in slices of
        the trio thread (:func:`in_slices`), the execution frozen from the check to the
        rename: a move between directories 60,000 deep walked their ancestors on the trio
        thread, 72 ms a rename."""
        old_parent, new_parent = self.table.node(old_parent_ino), self.table.node(new_parent_ino)
        ex = old_parent.view
        try:
            src = self.lookups.lookup(old_parent_ino, old_name)
            dst = self.lookups.lookup(new_parent_ino, new_name) \
                if flags & RENAME_EXCHANGE else None
        except NotFound:
            src = dst = None  # rename says which
        moves = [] if src is None or not isinstance(ex, Execution) or \
            new_parent.view is not ex else \
            self._moves_of_directories(src, dst, old_parent, new_parent)  # else rename refuses
        if not moves:
            return self.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags,
                               owner=owner)
        with ex.freeze():
            for directory, parent in moves:
                await in_slices(self._not_below_steps(ex, directory, parent))
            self.table.check_live(src)
            self.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags, checked=True,
                        owner=owner)

    def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int, new_name: bytes,
               flags: int, checked: bool = False, owner: tuple[int, int] = (0, 0)) -> None:
        """renameat2(2) with RENAME_NOREPLACE, RENAME_EXCHANGE and RENAME_WHITEOUT (a 0/0
        character device owned by ``owner``, ``(uid, gid)``, takes the source's name in the
        same transaction, as overlayfs expects of its upper file system); any other flag, or
        RENAME_EXCHANGE with another, is EINVAL.  Directories from the base move for real
        within an execution; EXDEV from another view.  ``checked``: no directory moves below
        itself (:meth:`rename_in_slices` made sure)."""
        if flags & ~(RENAME_NOREPLACE | RENAME_EXCHANGE | RENAME_WHITEOUT) or \
                flags & RENAME_EXCHANGE and flags != RENAME_EXCHANGE:
            raise fs_error(errno.EINVAL, f"rename flags {flags:#x} are not supported")
        old_parent, new_parent = self.table.node(old_parent_ino), self.table.node(new_parent_ino)
        if old_parent.view is not new_parent.view:
            raise fs_error(errno.EXDEV, "a rename cannot cross snapshots and executions")
        ex = self.upper.writable(old_parent)
        self.upper.writable(new_parent)
        check_name(new_name)
        check_not_reserved(ex, new_parent, new_name)
        src = self.lookups.lookup(old_parent_ino, old_name)
        try:
            dst: Node | None = self.lookups.lookup(new_parent_ino, new_name)
        except NotFound:
            dst = None
        exchange, noreplace = flags & RENAME_EXCHANGE, flags & RENAME_NOREPLACE
        if not checked:
            for directory, parent in self._moves_of_directories(src, dst if exchange else None,
                                                                old_parent, new_parent):
                run_steps(self._not_below_steps(ex, directory, parent))
        if exchange:
            if dst is None:
                raise NotFound(f"no {new_name!r}")
            with self._undone_on_failure(old_parent, new_parent, src, dst):
                if src.is_dir != dst.is_dir and old_parent.ino != new_parent.ino:
                    delta = 1 if src.is_dir else -1
                    new_parent.upper.nlink += delta
                    old_parent.upper.nlink -= delta
                src.parent, src.name, dst.parent, dst.name = (new_parent.ino, new_name,
                                                              old_parent.ino, old_name)
                self.upper.touch(src, mtime=False)
                self.upper.touch(dst, mtime=False)
                self._store_names([(old_parent, old_name, dst), (new_parent, new_name, src)])
            return
        if dst is not None:
            if dst.ino == src.ino:
                return
            if noreplace:
                raise fs_error(errno.EEXIST, f"{new_name!r} exists")
            if dst.is_dir and not src.is_dir:
                raise fs_error(errno.EISDIR)
            if src.is_dir and not dst.is_dir:
                raise fs_error(errno.ENOTDIR)
            if dst.is_dir and not self.lookups.is_empty_dir(dst):
                raise fs_error(errno.ENOTEMPTY)
        replaced = () if dst is None else (dst,)
        whiteout = self._unstored_node(old_parent, old_name, stat.S_IFCHR, *owner) \
            if flags & RENAME_WHITEOUT else None
        with self._undone_on_failure(old_parent, new_parent, src, dst):
            if dst is not None:
                self._count_link_down(new_parent, dst)
            if src.is_dir and old_parent.ino != new_parent.ino:
                old_parent.upper.nlink -= 1
                new_parent.upper.nlink += 1
            src.parent, src.name = new_parent.ino, new_name
            self.upper.touch(src, mtime=False)
            self._store_names([(old_parent, old_name, whiteout), (new_parent, new_name, src)],
                              *replaced)
        if whiteout is not None:
            ex.upper_inodes += 1
            self.table.nodes[whiteout.ino] = whiteout

