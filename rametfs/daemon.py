"""The daemon's lifecycle: mount, serve until a signal or an unmount, flush, unmount cleanly.

One pyfuse3 session per process.  SIGINT and SIGTERM end the session cleanly (pending records
stored, LMDB synced, the mount removed).  An unexpected exception leaves the mountpoint
mounted but dead on purpose: an empty-looking directory invites tools to delete data
(docs/concurrency.md).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import time

import pyfuse3
import trio

from . import allocator, protocol
from .control.commands import Control
from .control.tree import MountTree
from .errors import RametError
from .faults import FAULTS
from .fuse.adapter import Operations, PlainOperations
from .fuse.kernel import KernelState, requests_waiting
from .mounts import (bind_snapshots_read_only, check_mount_options, check_mountpoint,
                     mount_at, take_data_lock, write_data_lock)
from .overlay import (COLLECT_BATCH, MAX_FILE_SIZE, Overlay, drop_upper_files, in_slices,
                      yield_to_requests)
from .precreate import Precreated, keep_filled
from .store import Store
from .store.cache import default_max_bytes
from .store.remote import Remote
from .treewalk import Steps, run_steps
from .verify import ROOT

log = logging.getLogger(__name__)

DIRTY_INTERVAL_S = 1.0
RECLAIM_DELAY_S = 0.05  # forgotten unlinked inodes gathered into one batch (_reclaim_forgotten)
MAX_REQUEST_TASKS = 4096  # FUSE requests handled at once (pyfuse3 worker tasks)


def _lock_data_dir(data_dir: str, mountpoint: str) -> int:
    """Take ``<data_dir>/daemon.lock`` (flock, held while the returned descriptor is open)
    and write this daemon's pid and ``mountpoint`` in it: two daemons on one store would
    hand out the same inode numbers.  EBUSY if taken (rametfs.mounts.take_data_lock)."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    fd = take_data_lock(data_dir)
    write_data_lock(fd, mountpoint, "")
    return fd


# A full collection once every FULL_EVERY young (generation 1) ones, not CPython's 10: the
# permanent generation keeps what survived the last one, so a full collection traverses
# only what was made since, and its pause is in proportion to how often it runs (the total
# work is the same: each object is traversed by one full collection, then frozen).  With
# the default, a daemon creating 30,000 files paused 46-57 ms per full collection (57,000
# objects, every 6 s; a 2-core host at a load average of 7); with 1, at most 17 ms (10,000
# objects), and the worst of a bystander's rounds went from 109 ms to 27 ms.
FULL_EVERY = 1


def _freeze_survivors(phase: str, info: dict) -> None:
    """A ``gc.callbacks`` hook: after a full collection, move what survived it to the
    permanent generation (``gc.freeze``), so the next full collection traverses only objects
    made since, not every node and tree entry the daemon holds: each one stopped the trio
    thread, and every request, 0.2-1 s with a few 100,000-name trees held (docs/concurrency.md).
    The price: a reference cycle among objects that outlived a full collection is never
    freed; the daemon's records (nodes, entries, trees) form no cycles, and reference
    counting frees them as before."""
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


def plain_mode_reason() -> str | None:
    """Why the FUSE adapter runs in plain mode (tools/pyfuse3/README.md), or None in
    open-less mode: pyfuse3 lacks our patch, or ``RAMETFS_OPEN_LESS=0`` turns its use off
    (for comparison)."""
    if os.environ.get("RAMETFS_OPEN_LESS", "1") == "0":
        return "RAMETFS_OPEN_LESS=0 is set"
    if not hasattr(pyfuse3.FileInfo(), "cache_readdir"):
        return "this pyfuse3 lacks the open-less patch"
    return None


def detect_open_less() -> bool:
    """Whether the FUSE adapter runs open-less (:func:`plain_mode_reason`)."""
    return plain_mode_reason() is None


PLAIN_MODE_NOTE = ("plain mode ({reason}): warm git status is 5-10x slower and cold 2x than in "
                   "open-less mode; `rametfs build-pyfuse3` builds the patched pyfuse3 into "
                   "this Python, about a minute (tools/pyfuse3/README.md)")


RESTART_DELAYS_S = (1.0, 2.0, 5.0, 15.0, 60.0)  # before a failed task's 1st, 2nd ... restart


async def _guarded(name: str, task, *args) -> None:
    """Run background task ``task(*args)`` for the daemon's life: an exception (a bug, or a
    store error it does not handle) is logged with its traceback and the task starts again
    after a delay that grows with each failure in a row, so nothing else stops."""
    failures = 0
    while True:
        started = trio.current_time()
        try:
            await task(*args)
            return
        except Exception:
            if trio.current_time() - started > RESTART_DELAYS_S[-1]:
                failures = 0  # it had run well since the last failure
            delay = RESTART_DELAYS_S[min(failures, len(RESTART_DELAYS_S) - 1)]
            failures += 1
            log.exception("background task %s failed; restarting it in %g s", name, delay)
            await trio.sleep(delay)


# The memory of dropped nodes goes back to the system once a collection is done, when at
# least TRIM_NODES went since the last time (rametfs.allocator: jemalloc's purge, or glibc's
# malloc_trim under pymalloc).  Once the dead layers' records are deleted too, not before:
# under jemalloc the heap after each of 10 cycles of 20,000 files created and reset stayed
# within 2.0 MiB of the first reset's, against 2.9 MiB with the purge right after the nodes
# went (docs/benchmarks.md, rss-cycles).  Not after each batch of drop_stale_nodes: a batch
# frees nodes all over the heap, and few pages are wholly free before the last one.
TRIM_NODES = 10_000


async def _collect_dead_layers(overlay: Overlay) -> None:
    """Free what reset and release left behind, in the background: the nodes (their memory
    given back, see :data:`TRIM_NODES`), then the records and upper data of dead layers."""
    dropped = 0  # nodes freed since the memory was last given back
    while True:
        overlay.dead_layers = trio.Event()
        while overlay.stale_inos:
            dropped += overlay.drop_stale_nodes()
            await yield_to_requests()
        while (batch := overlay.collect_dead_layer()) is not None:
            FAULTS.check("task:dead-layers")
            layer, records_left = batch
            if not records_left:
                # Abandoned on unmount: the layer stays marked dead and the next start
                # finishes it.
                pool = overlay.precreated
                pool.hold(await trio.to_thread.run_sync(overlay.remove_layer_files, layer,
                                                        pool.room(), abandon_on_cancel=True))
                overlay.forget_dead_layer(layer)
            await yield_to_requests()
        if dropped >= TRIM_NODES:
            dropped = 0
            await trio.to_thread.run_sync(allocator.give_back)
        await overlay.dead_layers.wait()


EXPIRY_RETRY_NS = 1_000_000_000  # an expired lease whose execution is busy is retried after


async def _expire_leases(control: Control) -> None:
    """Return the executions whose lease ended to their pools (``Control.recycle``: reset,
    verify; quarantine when verification fails), sleeping until the next lease ends, a
    failed return is due again, or a lease taken or renewed ends sooner
    (``Control.leases_changed``)."""
    pools = control.pools
    retry_at: dict[str, int] = {}  # execution id -> when its failed return is tried again (ns)
    while True:
        control.leases_changed, control.leases_wake_ns = trio.Event(), 0
        now = time.time_ns()
        expired = pools.expired(now)
        retry_at = {m.execution: retry_at[m.execution] for m in expired
                    if m.execution in retry_at}
        for member in expired:
            if retry_at.get(member.execution, now) > now:
                continue
            log.info("lease of %s by %s (pid %d on %s) expired: returning it to pool %s",
                     member.execution, member.lease.holder, member.lease.pid, member.lease.host,
                     member.pool)
            try:
                FAULTS.check("task:leases", member.execution)
                await control.recycle(member.execution, member.lease.holder, ROOT,
                                      ended=member.lease)
            except RametError as exc:
                log.info("execution %s not returned yet: %s", member.execution, exc)
                retry_at[member.execution] = time.time_ns() + EXPIRY_RETRY_NS
            except Exception as exc:
                log.exception("returning execution %s to pool %s failed", member.execution,
                              member.pool)
                ex = control.overlay.executions.get(member.execution)
                if ex is not None:
                    control.overlay.fail(ex, f"internal error returning it to its pool: "
                                             f"{exc!r}")
                retry_at[member.execution] = time.time_ns() + EXPIRY_RETRY_NS
        deadline = min([*retry_at.values(), pools.next_expiry(after_ns=now) or math.inf])
        control.leases_wake_ns = deadline
        with trio.move_on_after(max(0.0, (deadline - time.time_ns()) / 1e9)):
            await control.leases_changed.wait()


async def _reclaim_forgotten(overlay: Overlay, wakeups: trio.MemoryReceiveChannel[None]
                             ) -> None:
    """Delete forgotten unlinked inodes (``Overlay.take_reclaim``) once woken (the mount
    tree's forget): their upper data files in a worker thread, then their records in
    transactions of ``COLLECT_BATCH`` inodes (50,000 in one held the trio thread 50 ms), in
    batches: what the kernel forgets in the :data:`RECLAIM_DELAY_S` after a wake-up (one
    forgotten while a batch goes wakes it again).  An ``rm -rf`` then waits for neither, and
    the loop hands a thread a job per 50 ms of forgets, not per file.  (Taking what came
    while the last batch went at once made small batches: the daemon's CPU for an ``rm -rf``
    of 12,000 files was 2.49-2.70 s that way, 2.33-2.42 s this way.)  A failed or cancelled
    batch stays marked orphan and goes at the next start (Overlay.remove_orphans)."""
    async for _ in wakeups:
        await trio.sleep(RECLAIM_DELAY_S)
        if items := overlay.take_reclaim():
            try:
                FAULTS.check("task:reclaim")
                pool = overlay.precreated
                pool.hold(await trio.to_thread.run_sync(drop_upper_files, items, pool,
                                                        pool.room()))
                for start in range(0, len(items), COLLECT_BATCH):  # a bounded step each
                    overlay.reclaimed(items[start:start + COLLECT_BATCH])
                    await yield_to_requests()
            except OSError as exc:  # a RametError too; the next start deletes them
                log.warning("reclaiming %d forgotten inodes failed: %s", len(items), exc)
            except Exception as exc:
                log.exception("reclaiming %d forgotten inodes failed", len(items))
                for ex in overlay.executions_of(items):
                    overlay.fail(ex, f"internal error reclaiming its inodes: {exc!r}")


async def _store_dirty_records(overlay: Overlay) -> None:
    """Store changed inode records every :data:`DIRTY_INTERVAL_S`: the kernel does not say
    when a file is closed (open-less FUSE), so this bounds what a crash loses of data that
    was never fsync'd."""
    while True:
        await trio.sleep(DIRTY_INTERVAL_S)
        await in_slices(_flush_each(overlay))


def _flush_each(overlay: Overlay) -> Steps[None]:
    """Store the dirty records of every execution not marked failed, as steps
    (``Overlay.flush_steps``): a store error (a full disk) leaves that execution's records
    dirty for the next round, and an unexpected exception marks that execution failed;
    either way the others are stored."""
    for ex in list(overlay.executions.values()):
        if ex.failure is not None:
            continue
        try:
            FAULTS.check("task:flush", ex.id)
            yield from overlay.flush_steps(ex)
        except RametError as exc:
            log.warning("storing the records of execution %s failed, tried again in %g s: %s",
                        ex.id, DIRTY_INTERVAL_S, exc)
        except Exception as exc:
            log.exception("storing the records of execution %s failed", ex.id)
            overlay.fail(ex, f"internal error storing its records: {exc!r}")


async def _bind_snapshots(control: Control) -> None:
    """Make ``snapshots/`` a read-only mount (rametfs.mounts); ``serve --background``
    returns once this is settled.  (Lookups cannot wait for it: the kernel holds the
    directory's lock during a lookup, and the mount needs that lock.)"""
    # Abandoned on cancel: a mount call still waiting for a lookup ends when the session closes.
    failure = await trio.to_thread.run_sync(bind_snapshots_read_only, control.mountpoint,
                                            abandon_on_cancel=True)
    if failure is not None:
        log.warning("snapshots/ not bound read-only (%s): a shared writable mmap of a "
                    "snapshot file changes its cached pages until their write-back", failure)
    control.snapshots_bind_failure = failure
    control.snapshots_settled = True


async def _serve(overlay: Overlay, control: Control, kernel: KernelState,
                 reclaim: trio.MemoryReceiveChannel[None],
                 refused: trio.MemoryReceiveChannel[int]) -> None:
    """The daemon's one nursery: every background task (docs/concurrency.md) and the
    pyfuse3 session; ``reclaim`` and ``refused`` feed the tasks the mount's requests give
    work (the mount tree's and the kernel state's other ends)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_guarded, "snapshots-bind", _bind_snapshots, control)
        nursery.start_soon(_guarded, "precreate", keep_filled, overlay.precreated)
        nursery.start_soon(_guarded, "dead-layers", _collect_dead_layers, overlay)
        nursery.start_soon(_guarded, "flush", _store_dirty_records, overlay)
        nursery.start_soon(_guarded, "leases", _expire_leases, control)
        nursery.start_soon(_guarded, "reclaim", _reclaim_forgotten, overlay, reclaim)
        nursery.start_soon(_guarded, "refused-pages", kernel.drop_refused_pages, refused)

        async def on_signal():
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("signal %d: cancelling running commands, unmounting", signum)
                    # pyfuse3.main returns once every request is answered: a long capture
                    # would hold the exit (and its caller) until done.
                    await control.cancel_all("the daemon stopping")
                    pyfuse3.terminate()

        nursery.start_soon(on_signal)
        # Requests waiting on a frozen execution each hold a worker task: more of them than
        # pyfuse3's default 99, so one execution's waiting writers cannot take them all.
        await pyfuse3.main(max_tasks=MAX_REQUEST_TASKS)
        nursery.cancel_scope.cancel()


def run_daemon(data_dir: str, mountpoint: str, *, allow_other: bool = False,
               debug: bool = False, max_file_size: int | None = None,
               cache_max_bytes: int | None = None, max_answer_bytes: int | None = None,
               faults: bool = False, allow_devices: bool = False,
               allow_suid: bool = False, fsname: str = "rametfs", remote: str | None = None,
               catalog: str | None = None) -> None:
    """Mount the store in ``data_dir`` at ``mountpoint`` and serve in the foreground.

    The mount is ``nodev,nosuid`` unless ``allow_devices`` (``dev``: device nodes in
    executions open their devices) or ``allow_suid`` (``suid``: set-user-ID and
    set-group-ID files run with their owner's or group's ids); both need root (EPERM,
    :func:`rametfs.mounts.check_mount_options`); docs/security.md says what they risk.
    ``fsname``: the mount's source in the mount table (its type stays ``fuse.rametfs``).

    ``max_file_size``: the size in bytes past which a file may not grow (EFBIG; None:
    ``overlay.MAX_FILE_SIZE``); ``cache_max_bytes``: the hydration cache's limit on disk
    (None: a quarter of the data directory's file system, rametfs.store.cache);
    ``max_answer_bytes``: of one control file answer (None: protocol.MAX_ANSWER_BYTES);
    ``remote`` and ``catalog``: the remote published snapshots are read from (s3:// URL, libpq
    DSN; rametfs.store.remote).

    Returns after a clean unmount (SIGINT, SIGTERM, ``rametfs umount`` or
    ``fusermount3 -u -z``).  ``faults`` enables the ``fault`` command (rametfs.faults).  Raises
    RametError when another daemon serves ``data_dir`` (EBUSY, naming it), the mountpoint
    is missing (ENOENT), not a directory (ENOTDIR), mounted (EBUSY) or not empty
    (ENOTEMPTY), or the store cannot be opened.
    """
    memory_from = allocator.settle()
    check_mount_options(allow_devices, allow_suid)
    mountpoint = os.path.realpath(mountpoint)
    lock = _lock_data_dir(data_dir, mountpoint)
    try:
        check_mountpoint(mountpoint)
    except RametError:
        os.close(lock)
        raise
    try:
        options = {option for option, on in (("allow_other", allow_other),
                                             ("dev", allow_devices), ("suid", allow_suid),
                                             ("debug", debug)) if on}
        options.add(f"fsname={fsname}")
        _serve_store(data_dir, mountpoint, lock, options,
                     MAX_FILE_SIZE if max_file_size is None else max_file_size,
                     default_max_bytes(data_dir) if cache_max_bytes is None else cache_max_bytes,
                     max_answer_bytes or protocol.MAX_ANSWER_BYTES, faults, remote, catalog,
                     memory_from)
    finally:
        os.close(lock)


def _serve_store(data_dir: str, mountpoint: str, lock: int, options: set[str],
                 max_file_size: int, cache_max_bytes: int, max_answer_bytes: int,
                 faults: bool, remote: str | None, catalog: str | None,
                 memory_from: str) -> None:
    """Serve until unmounted; ``lock``: the data directory lock's descriptor; ``options``:
    the FUSE mount options added to rametfs's own (``fsname=``, ``allow_other``, ``dev``,
    ``suid``, ``debug``); ``memory_from``: the allocator (rametfs.allocator.settle)."""
    store = Store(data_dir, cache_max_bytes)  # scans the cache, removes dead temporary files
    if remote is not None:
        store.remote = Remote(remote, catalog)
        log.info("reading published snapshots from %s (catalog %s)", remote,
                 store.remote.catalog.where)
    overlay = Overlay(store)
    overlay.max_file_size = max_file_size
    overlay.remove_orphans()
    overlay.count_usage()
    overlay.precreated = Precreated(overlay.upper_root)
    reason = plain_mode_reason()
    reclaim_send, reclaim_recv = trio.open_memory_channel[None](1)  # a pending wake-up
    refused_send, refused_recv = trio.open_memory_channel[int](math.inf)  # one per inode due
    kernel = KernelState(refused_send)
    control = Control(overlay, mountpoint, kernel.invalidate, open_less=reason is None,
                      faults=faults, max_answer_bytes=max_answer_bytes)
    control.adapter_memory = kernel.memory
    control.allocator = memory_from
    tree = MountTree(overlay, control, reclaim_send, other_uids="allow_other" in options)
    ops = (Operations if reason is None else PlainOperations)(tree, kernel)
    pyfuse3.init(ops, mountpoint, set(pyfuse3.default_options) | options |
                 {"subtype=rametfs"})
    tree.requests_waiting = requests_waiting()
    mounted = mount_at(mountpoint)  # from the mount table: no request to ourselves
    write_data_lock(lock, mountpoint, mounted.dev if mounted is not None else "")
    log.info("serving %s at %s (pid %d, %s mode) on %s; files up to %d bytes; hydration "
             "cache %d of %d bytes", store.root, mountpoint, os.getpid(),
             "open-less" if reason is None else "plain", memory_from, max_file_size,
             store.cache.bytes, cache_max_bytes)
    if reason is not None:
        log.info("%s", PLAIN_MODE_NOTE.format(reason=reason))
    clean = False
    gc.callbacks.append(_freeze_survivors)
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], FULL_EVERY)
    try:
        trio.run(_serve, overlay, control, kernel, reclaim_recv, refused_recv)
        clean = True
    finally:
        gc.callbacks.remove(_freeze_survivors)
        gc.set_threshold(*thresholds)
        if clean:
            run_steps(_flush_each(overlay))
        pyfuse3.close(unmount=clean)
        store.close()
        if store.remote is not None:
            store.remote.close()
        log.info("unmounted %s", mountpoint) if clean else log.error("crashed; mount left in place")
