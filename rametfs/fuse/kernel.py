"""What the kernel was told, and telling it to forget: the FUSE adapter's bookkeeping.

* the directory listings the kernel pages through (readdir offsets stay valid between calls);
* the missing names of executions' directories it caches (negative entries), which a reset
  or release must make it forget where names change (the root, rebound directories);
* its lookup counts of control file generations, whose last forget drops them
  (rametfs.control.tree);
* invalidation of dentries and inodes (reset, release, commands), in a worker thread;
* snapshot inodes whose write-back was refused (a shared writable mmap, open-less), whose
  changed pages are dropped by :meth:`KernelState.drop_refused_pages`, a daemon task fed by a
  channel;
* whether requests wait in the kernel's queue to be read (:func:`requests_waiting`).
"""

from __future__ import annotations

import itertools
import logging
import os
import select
from collections import OrderedDict
from collections.abc import Callable, Sequence

import pyfuse3
import trio

from ..control.tree import CACHE_TIMEOUT, EXECUTIONS, Entry
from ..faults import FAULTS
from ..overlay import in_slices
from ..treewalk import Steps

log = logging.getLogger(__name__)

LISTINGS = 64  # directory listings kept between the readdir calls that page through them
LISTING_ENTRIES = 1 << 20  # entries of those listings (about 100 bytes each)
NEGATIVE_NAMES = 16384  # missing names cached per execution (KernelState.negative)
FORGET_STEP = 1024  # inodes an invalidation looks at per step (KernelState._forget_steps)


def requests_waiting() -> Callable[[], bool]:
    """A check of whether a request waits in the kernel's queue to be read: a poll(2) of this
    process's FUSE device with no timeout (about a microsecond).  Call it after
    ``pyfuse3.init``: pyfuse3 keeps the session's descriptor to itself, so it is found as
    the one in ``/proc/self/fd`` that is ``/dev/fuse`` (one session per process).  Raises
    RuntimeError when there is none."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                break
        except OSError:  # the descriptor of the listing itself, closed meanwhile
            continue
    else:
        raise RuntimeError("no /dev/fuse descriptor: pyfuse3.init has not run")
    poller = select.poll()
    poller.register(int(name), select.POLLIN)
    return lambda: bool(poller.poll(0))


class KernelState:
    """The kernel's side of the mount, as far as the daemon must remember it.  ``refused``
    is sent each snapshot inode whose write-back was refused, once while its drop is due
    (the daemon runs :meth:`drop_refused_pages` over the other end)."""

    def __init__(self, refused: trio.MemorySendChannel[int]):
        self.listings: OrderedDict[int, list[tuple[bytes, int]]] = OrderedDict()
        self.listing_entries = 0  # entries of every kept listing
        self.negative: dict[int, set[bytes]] = {}  # directory ino -> names told missing
        self.negative_scope: dict[int, str] = {}  # directory ino -> its execution's id
        self.negative_counts: dict[str, int] = {}  # execution id -> its names in ``negative``
        self.lookups: dict[int, int] = {}  # control file generation -> the kernel's lookups
        # snapshot inode whose pages are being dropped -> a WRITE came since the drop began
        self.refused_pages: dict[int, bool] = {}
        self.refused = refused

    def memory(self) -> dict[str, int]:
        """The sizes of the kept tables (the root status's ``memory``)."""
        return {"listings": len(self.listings), "listing_entries": self.listing_entries}

    # -- listings ------------------------------------------------------------------------

    def listing(self, ino: int, start: int) -> list[tuple[bytes, int]] | None:
        """The listing of ``ino`` kept for a readdir from offset ``start``; None when it
        must be made again (a read from 0 starts over)."""
        listing = self.listings.get(ino)
        if listing is None or start == 0:
            return None
        self.listings.move_to_end(ino)
        return listing

    def keep_listing(self, ino: int, listing: list[tuple[bytes, int]]
                     ) -> list[tuple[bytes, int]]:
        """Keep ``listing`` for the readdir calls to come, and return it; the oldest kept go
        while more than :data:`LISTINGS` listings or :data:`LISTING_ENTRIES` entries are."""
        old = self.listings.pop(ino, None)
        self.listing_entries += len(listing) - (len(old) if old is not None else 0)
        while self.listings and (len(self.listings) >= LISTINGS
                                 or self.listing_entries > LISTING_ENTRIES):
            self.listing_entries -= len(self.listings.popitem(last=False)[1])
        self.listings[ino] = listing
        return listing

    # -- entries -------------------------------------------------------------------------

    def looked_up(self, entry: Entry) -> None:
        """The kernel was given ``entry`` (a lookup or a listing's): count it if it is a
        control file generation's."""
        if entry.generation:
            ino = entry.attrs.ino
            self.lookups[ino] = self.lookups.get(ino, 0) + 1

    def negative_entry(self, parent: int, name: bytes, scope: str | None) -> float:
        """The kernel is told ``name`` is missing in ``parent``: for how long it may cache
        that (seconds).  A directory of an execution (``scope``, its id) keeps its names for
        the reset that makes the kernel forget them (the root's, and a rebound directory's:
        their names change), :data:`NEGATIVE_NAMES` an execution at most: past them a name
        is not cached, so the sets and that reset stay bounded whatever one execution
        looks up."""
        if scope is None:
            return CACHE_TIMEOUT
        names = self.negative.setdefault(parent, set())
        if name in names:
            return CACHE_TIMEOUT
        count = self.negative_counts.get(scope, 0)
        if count < NEGATIVE_NAMES:
            names.add(name)
            self.negative_scope[parent] = scope
            self.negative_counts[scope] = count + 1
            return CACHE_TIMEOUT
        if not names:
            del self.negative[parent]
        return 0

    def _forget_negative(self, ino: int) -> set[bytes]:
        """The missing names of directory ``ino`` the kernel was told, forgotten here."""
        names = self.negative.pop(ino, None)
        if not names:
            return set()
        scope = self.negative_scope.pop(ino)
        left = self.negative_counts[scope] - len(names)
        if left:
            self.negative_counts[scope] = left
        else:
            del self.negative_counts[scope]
        return names

    def forgotten(self, inode_list: Sequence[tuple[int, int]]) -> list[int]:
        """The kernel forgot ``(ino, count)`` lookups: the control file generations it now
        holds no lookup of."""
        gone = []
        for ino, count in inode_list:
            left = self.lookups.get(ino)
            if left is None:
                continue
            if left > count:
                self.lookups[ino] = left - count
            else:
                del self.lookups[ino]
                gone.append(ino)
        return gone

    # -- invalidation --------------------------------------------------------------------

    async def invalidate(self, entries: list[tuple[int, bytes]],
                         inodes: Sequence[int] = ()) -> None:
        """Make the kernel forget dentries ``(parent ino, name)`` (parent 0: an execution
        root's entry in ``executions/``), inodes ``(ino, b"")`` and inodes ``inodes``, with
        the missing names it was told of a directory among them (a reset's root and rebound
        directories, a release's every one).  Returns when the kernel is done, also when
        cancelled meanwhile (what a reset dropped must not stay cached).  What to tell is
        found in slices of the trio thread (a reset of 50,000 known files names 50,000
        inodes); the kernel calls block until related requests finish, so they run in a
        worker thread while the loop goes on serving."""
        with trio.CancelScope(shield=True):
            negative = await in_slices(self._forget_steps(entries, inodes))
            await trio.to_thread.run_sync(self._invalidate_now, entries, inodes, negative)

    def _forget_steps(self, entries: list[tuple[int, bytes]], inodes: Sequence[int]
                      ) -> Steps[list[tuple[int, set[bytes]]]]:
        """Forget the missing names and the kept listings of the inodes named (those of a
        dropped layer would stay until 64 others pushed them out: a reset kept a
        20,000-name listing, 2 MB); returns the missing names, ``(directory ino, names)``
        (not a pair per name: 16,384 of them made on the trio thread, and the collections
        they set off, were one more long step of a reset).  A step per :data:`FORGET_STEP`
        inodes or entries."""
        negative: list[tuple[int, set[bytes]]] = []

        def forget(ino: int, listing: bool) -> None:
            if ino in self.negative:
                negative.append((ino, self._forget_negative(ino)))
            if listing and (kept := self.listings.pop(ino, None)) is not None:
                self.listing_entries -= len(kept)

        for i, (ino, name) in enumerate(entries, 1):
            if i % FORGET_STEP == 0:
                yield
            forget(ino, not name)  # an inode, or the parent of a name told (its listing stays)
        for i, ino in enumerate(inodes, 1):
            if i % FORGET_STEP == 0:
                yield
            forget(ino, True)
        return negative

    @staticmethod
    def _invalidate_now(entries: list[tuple[int, bytes]], inodes: Sequence[int],
                        negative: Sequence[tuple[int, set[bytes]]] = ()) -> None:
        missing = ((ino, name) for ino, names in negative for name in names)
        for ino, name in itertools.chain(entries, missing, zip(inodes, itertools.repeat(b""))):
            try:
                if name:  # parent 0 is an execution root's entry in executions/
                    pyfuse3.invalidate_entry(ino or EXECUTIONS, name)
                else:
                    pyfuse3.invalidate_inode(ino)
            except OSError:
                pass  # the kernel does not know it

    # -- refused write-backs -------------------------------------------------------------

    def refused_write_back(self, ino: int) -> None:
        """A WRITE to snapshot inode ``ino`` was refused: open-less, the kernel cannot refuse
        a shared writable mmap of a snapshot file where ``snapshots/`` is not a read-only
        mount, and this was its write-back.  Its changed pages are dropped once the WRITE
        is answered, again if another comes meanwhile."""
        if ino in self.refused_pages:
            self.refused_pages[ino] = True
        else:
            self.refused_pages[ino] = False
            self.refused.send_nowait(ino)  # an unbounded channel: one item per inode due

    async def drop_refused_pages(self, inos: trio.MemoryReceiveChannel[int]) -> None:
        """The daemon's task: drop the cached pages of each snapshot inode received."""
        async for ino in inos:
            try:
                while True:
                    FAULTS.check("task:refused-pages")
                    await self.invalidate([(ino, b"")])
                    if not self.refused_pages[ino]:
                        break
                    self.refused_pages[ino] = False
            except Exception:  # that inode's pages stay; the next refused write tries again
                log.exception("dropping the refused pages of snapshot inode %d failed", ino)
            finally:
                del self.refused_pages[ino]
