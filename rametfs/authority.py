"""Who may do what with an execution: its owner, group and share mode, what its own
control files may do (``--control``), and how much it may store (``--max-bytes``,
``--max-inodes``).  docs/security.md, "Authority", is the model in full.

An execution is owned like a directory: an ``owner`` (uid), a ``group`` (gid) and ``share``,
its permission bits (default 0700).  The bits of the caller's class (as POSIX chooses it: the
owner's for the owner, else the group's for a member of the group, else the others') say what
the caller may do through the mount:

* ``x``: enter the tree ``executions/<id>/`` (inside, its files' own modes apply);
* ``r``: see it in the root status, read its ``.ramet/`` files;
* ``w``: write its ``.ramet/ctl`` and ``.ramet/promote`` (when ``control`` is ``full``).

The *harness* (uid 0, or the daemon's own uid: who can write the root ``ctl``, mode 0600) may
do anything, as root may with a directory.  ``control`` is what the execution's own control
files allow, whoever writes them: ``full`` (every execution command), ``read`` (the files read;
a write to ``ctl`` or ``promote`` is EACCES) or ``none`` (no ``.ramet``: ENOENT).  The
harness acts on any execution through the root ``ctl`` whatever its ``control``.

``max_bytes`` and ``max_inodes`` bound what its upper layer takes (the disk blocks of its data
files; its upper inode records, copies-up included), like ext4 project quotas: EDQUOT past
them (rametfs.overlay).  None: no limit.

Standard library only: the daemon and fallback mode share it.
"""

from __future__ import annotations

import functools
import os
import stat
from dataclasses import dataclass

from . import protocol

R, W, X = 4, 2, 1  # the permission bits of one class
DEFAULT_SHARE = 0o700
DAEMON_UID, DAEMON_GID = os.getuid(), os.getgid()


@dataclass(frozen=True)
class Caller:
    """Who sent a FUSE request: its fs uid and gid, and its thread id in the daemon's pid
    namespace (for its supplementary groups, read only for a caller that is neither the
    harness nor the owner)."""

    uid: int
    gid: int
    pid: int = 0

    @property
    def harness(self) -> bool:
        return self.uid in (0, DAEMON_UID)

    @functools.cached_property
    def groups(self) -> frozenset[int]:
        """The primary group and the supplementary ones of ``/proc/<pid>/status`` (the
        requester waits in its system call, so the pid is still its own); only the primary
        group when that file cannot be read."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                line = next((line for line in f if line.startswith("Groups:")), "Groups:")
        except OSError:
            line = "Groups:"
        return frozenset([self.gid, *map(int, line.split()[1:])])


HARNESS = Caller(DAEMON_UID, DAEMON_GID)


@dataclass(frozen=True)
class Access:
    """Who may use an execution, what its control files do and how much it may store (see
    the module docstring).

    ``share`` holds permission bits only (0 to 0o777) and always grants the owner ``rwx``;
    ``max_bytes`` is in bytes.
    """

    owner: int = DAEMON_UID
    group: int = DAEMON_GID
    share: int = DEFAULT_SHARE
    control: str = protocol.CONTROL_FULL
    max_bytes: int | None = None
    max_inodes: int | None = None

    def bits(self, caller: Caller) -> int:
        """The permission bits that apply to ``caller``: 7 for the harness and the owner."""
        if caller.harness or caller.uid == self.owner:
            return 7
        if self.group in caller.groups:
            return self.share >> 3 & 7
        return self.share & 7

    def allows(self, caller: Caller, bits: int) -> bool:
        return self.bits(caller) & bits == bits

    @property
    def anyone_enters(self) -> bool:
        """Whether every caller may enter (``x`` for the group and for others: POSIX gives
        a group member the group's bits, not the others')."""
        return self.share & (X << 3 | X) == X << 3 | X

    def mode(self, kind: str) -> int:
        """``st_mode`` of the execution's ``.ramet`` directory (``kind`` ``"dir"``) or of its
        control file ``kind``, so the kernel (``default_permissions``) refuses what the share
        mode does not grant: per class, the directory ``r-x`` where the class has them; a
        file read where the class has ``r``; ``ctl`` and ``promote`` also written where the
        class has ``w`` and ``control`` is ``full``; ``fsmonitor`` (a query git runs and
        writes to) ``rwx`` where the class has ``r``."""
        out = 0
        for shift in (6, 3, 0):
            c = self.share >> shift & 7
            if kind == "dir":
                bits = c & (R | X)
            elif not c & R:
                bits = 0
            elif kind == protocol.FSMONITOR:
                bits = R | W | X
            elif kind in (protocol.CTL, protocol.PROMOTE) and c & W \
                    and self.control == protocol.CONTROL_FULL:
                bits = R | W
            else:
                bits = R
            out |= bits << shift
        return (stat.S_IFDIR if kind == "dir" else stat.S_IFREG) | out

    def to_record(self) -> dict:
        return {"owner": self.owner, "group": self.group, "share": self.share,
                "control": self.control, "max_bytes": self.max_bytes,
                "max_inodes": self.max_inodes}

    @classmethod
    def from_record(cls, rec: dict) -> Access:
        """From a stored record; a record from before these settings existed reads as the
        defaults (owned by the daemon's uid, 0700, control ``full``, no limits)."""
        return cls(rec.get("owner", DAEMON_UID), rec.get("group", DAEMON_GID),
                   rec.get("share", DEFAULT_SHARE), rec.get("control", protocol.CONTROL_FULL),
                   rec.get("max_bytes"), rec.get("max_inodes"))

    def describe(self) -> str:
        """``owner 0, group 0, share 0700, control full, max_bytes None, max_inodes None``:
        for messages."""
        return ", ".join(f"{key} {value}" for key, value in self.to_json().items())

    def to_json(self) -> dict:
        """``{"owner", "group", "share", "control", "max_bytes", "max_inodes"}``, ``share``
        as octal text (``"0750"``), a limit None when there is none."""
        return {"owner": self.owner, "group": self.group, "share": f"{self.share:04o}",
                "control": self.control, "max_bytes": self.max_bytes,
                "max_inodes": self.max_inodes}

    def options(self) -> protocol.Access:
        """As a command's options: the inverse of :meth:`given`."""
        return protocol.Access(self.owner, self.group, self.share, self.control,
                               self.max_bytes, self.max_inodes)

    def given(self, options: protocol.Access) -> Access:
        """This with the access options of a ``create`` or ``pool`` command applied (their
        values checked by rametfs.protocol)."""
        return Access(*(mine if given is None else given for mine, given in zip(
            (self.owner, self.group, self.share, self.control, self.max_bytes,
             self.max_inodes),
            (options.owner, options.group, options.share, options.control,
             options.max_bytes, options.max_inodes))))


class ReadIndex:
    """The executions each caller may read (their ``r`` bit, :meth:`Access.allows`), found
    in O(what it may read): ids by owner, by group where the group has ``r``, and those whose
    others have ``r``.  ``add`` and ``remove`` as executions come and go (an execution's
    access never changes)."""

    def __init__(self) -> None:
        self.access: dict[str, Access] = {}
        self.by_owner: dict[int, set[str]] = {}
        self.by_group: dict[int, set[str]] = {}  # the group has r
        self.by_others: set[str] = set()  # the others have r

    def add(self, eid: str, access: Access) -> None:
        self.access[eid] = access
        self.by_owner.setdefault(access.owner, set()).add(eid)
        if access.share >> 3 & R:
            self.by_group.setdefault(access.group, set()).add(eid)
        if access.share & R:
            self.by_others.add(eid)

    def remove(self, eid: str) -> None:
        access = self.access.pop(eid)
        for table, key in ((self.by_owner, access.owner), (self.by_group, access.group)):
            ids = table.get(key)
            if ids is not None:
                ids.discard(eid)
                if not ids:
                    del table[key]
        self.by_others.discard(eid)

    def readable(self, caller: Caller) -> set[str]:
        """The ids of the executions ``caller`` (not the harness) may read, as
        :meth:`Access.allows` says: its own, its groups' with the group's ``r`` unless it
        owns them, and the others' ``r`` of those neither its own nor its groups'."""
        uid, out = caller.uid, set(self.by_owner.get(caller.uid, ()))
        groups = caller.groups if self.by_group or self.by_others else frozenset()
        for gid in groups:
            out.update(e for e in self.by_group.get(gid, ()) if self.access[e].owner != uid)
        out.update(e for e in self.by_others if (a := self.access[e]).owner != uid
                   and a.group not in groups)
        return out
