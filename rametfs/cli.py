"""The ``rametfs`` command line: mount, and drive the mount through :mod:`rametfs.client`.

Every command but ``mount`` (alias ``serve``), ``umount``, ``fsck`` and ``build-pyfuse3``
takes ``-m/--mount`` (default ``$RAMET_MOUNT``; ``umount`` takes it as its argument, with the
same default), or in fallback mode (``--mode fallback``, or ``auto`` on a host without
``/dev/fuse``; default ``$RAMET_MODE``) ``--data`` (default ``$RAMET_DATA``): then the
command runs in this process on the data directory, no daemon involved.  ``-m`` may name an
execution's directory too: the commands on one execution then act on it (their EXECUTION
argument may be left out); the others use the mount holding it, or, inside a sandbox where
only the execution is in reach, say in one line that they need the mountpoint.
Exit codes (:data:`EXIT_HELP`): 0 ok, 2 usage, and for a failed operation the code
:data:`EXIT_CODES` gives its errno (rametfs.errors; 1 for any other); the message goes to stderr as
``rametfs: <message>``.  No user error prints a traceback.
"""

from __future__ import annotations

import contextlib
import decimal
import errno
import functools
import itertools
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import click

from rametfs import __version__, allocator, mounts, protocol
from rametfs.core.policy import CLASSES
from rametfs.client import (DATA_ENV, DEFAULT_TTL, MODE_ENV, MODES, MOUNT_ENV, Execution,
                            NotMountedError, Ramet, RametError, RestoreError, resolve_mode)
from rametfs.errors import EXIT_CODES, exit_code
from rametfs.protocol import quote_path

EXIT_OTHER = 1  # failed otherwise (errors.exit_code of another errno)
EXIT_HELP = """\b
Exit codes:
  0  ok
  1  failed otherwise (EIO, EDQUOT, ECANCELED ...; verify and fsck: differences found;
     return: the execution was quarantined)
  2  usage error
  3  ENOENT    no such snapshot, execution or path
  4  EINVAL    malformed argument or command
  5  EBUSY     busy (umount: in use; an execution running another command)
  6  ENOSPC    no space left
  7  ENOTCONN  no rametfs mounted there
  8  EEXIST    the name is taken
  9  EACCES    not allowed (docs/security.md)
The message is on stderr, as "rametfs: <message>"."""
WAIT_SECONDS = 30.0
CANCELLED_GRACE_S = 2.0  # a busy unmount is tried again for this long after a cancel
_POLL_SECONDS = 0.05


class _Group(click.Group):
    """Turns a RametError or an OSError from any command into ``rametfs: <message>`` and
    its exit code."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except RametError as exc:
            click.echo(f"rametfs: {printable(str(exc), lines=True)}", err=True)
            raise click.exceptions.Exit(exc.exit_code) from None
        except OSError as exc:  # a file the command reads or writes itself
            where = f"{os.fsdecode(exc.filename)}: " if exc.filename else ""
            click.echo(f"rametfs: {printable(where + (exc.strerror or str(exc)))}", err=True)
            raise click.exceptions.Exit(exit_code(exc.errno)) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=EXIT_HELP)
@click.version_option(__version__, prog_name="rametfs")
def main() -> None:
    """rametfs: immutable snapshots and copy-on-write executions over FUSE.

    Start with `rametfs mount --data DIR MOUNTPOINT --background`, then
    `export RAMET_MOUNT=MOUNTPOINT`.  -m may also name an execution's directory
    (MOUNTPOINT/executions/ID, or /workspace in a sandbox): its commands then act on it.
    Without FUSE (--mode fallback), executions are real directories under --data.
    The control files and their commands: docs/protocol.md.
    """


_RAMET_OPTIONS = (
    click.option("-m", "--mount", envvar=MOUNT_ENV, metavar="MOUNTPOINT", show_envvar=True,
                 help="The rametfs mountpoint (FUSE mode)."),
    click.option("--data", envvar=DATA_ENV, metavar="DIR", show_envvar=True,
                 type=click.Path(file_okay=False),
                 help="The data directory (fallback mode)."),
    click.option("--mode", envvar=MODE_ENV, type=click.Choice(MODES), show_envvar=True,
                 help="fuse (default): drive the mount; fallback: executions are real "
                      "directories under --data; auto: fallback when /dev/fuse is missing."),
)


def ramet_options(command):
    """Give ``command`` the -m/--mount, --data and --mode options; it receives the
    :class:`Ramet` they name as ``ramet``.  A missing mountpoint or data directory is a usage
    error (exit 2)."""
    @functools.wraps(command)
    def with_ramet(*args, mount: str | None, data: str | None, mode: str | None, **kwargs):
        if resolve_mode(mode) == "fallback":
            if not data:
                raise click.UsageError(f"fallback mode needs --data (or ${DATA_ENV}).")
        elif not mount:
            raise click.UsageError(f"Missing option '-m' / '--mount' (or ${MOUNT_ENV}).")
        with Ramet(mount, data=data, mode=mode) as ramet:
            return command(*args, ramet=ramet, **kwargs)

    for option in reversed(_RAMET_OPTIONS):
        with_ramet = option(with_ramet)
    return with_ramet


execution_argument = click.argument("execution", required=False)


def target(ramet: Ramet, execution: str | None) -> Execution:
    """The execution a command acts on: EXECUTION, else the one whose directory -m names.
    A usage error (exit 2) when neither is given; EINVAL when both are and differ."""
    here = ramet.here
    if execution is None:
        if here is None:
            raise click.UsageError("Missing argument 'EXECUTION' (or give -m an execution's "
                                   "directory).")
        return here
    if here is not None and execution != here.id:
        raise RametError(errno.EINVAL, f"-m names the directory of execution {here.id}, not "
                         f"of {execution!r}: leave EXECUTION out, or give -m the mountpoint")
    return ramet.execution(execution)


label_option = click.option("--label", help="A short name for the snapshot "
                            f"(at most {protocol.MAX_LABEL_BYTES} bytes).")


def _policy_value(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """``tree``, ``none``, or the path of a policy file that exists (else a usage error)."""
    if value is None or value in (protocol.POLICY_TREE, protocol.POLICY_NONE):
        return value
    return click.Path(dir_okay=False, exists=True).convert(value, param, ctx)


def policy_option(default: str):
    return click.option(
        "--policy", metavar="FILE|tree|none", callback=_policy_value,
        help=f"The persistence policy: a TOML file, tree (the tree's own ramet.toml) or none "
             f"(keep everything; a file of that name: ./none).  Default: {default}.")


message_option = click.option("--message", help="A longer description of the snapshot "
                              f"(at most {protocol.MAX_MESSAGE_BYTES} bytes).")


class ByteSize(click.ParamType):
    """A size in bytes written as ``truncate -s`` takes it: digits, optionally with a unit
    (``K``, ``M``, ``G``, ``T``, ``P``, ``E`` or ``KiB``...: powers of 1024; ``KB``, ``MB``...:
    powers of 1000), so ``1G``, ``1.5G`` and ``1073741824`` are one GiB (GNU coreutils'
    convention, which ``rametfs ls`` prints back), between ``minimum`` and ``maximum``."""

    name = "bytes"
    _FORM = re.compile(r"(\d+(?:\.\d+)?)(?:([KMGTPE])(iB|B)?)?", re.IGNORECASE)

    def __init__(self, minimum: int = 0, maximum: int = 2**63 - 1) -> None:
        self.minimum, self.maximum = minimum, maximum

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            size = value
        else:
            form = self._FORM.fullmatch(value.strip())
            if form is None:
                self.fail(f"{value!r} is not a size such as 1073741824, 512M or 1.5G", param, ctx)
            digits, unit, suffix = form.groups()
            base = 1000 if suffix and suffix.upper() == "B" else 1024
            scale = base ** ("KMGTPE".index(unit.upper()) + 1) if unit else 1
            size = int(decimal.Decimal(digits) * scale)
        if not self.minimum <= size <= self.maximum:
            self.fail(f"{value} is {size} bytes, not in {self.minimum}..{self.maximum}",
                      param, ctx)
        return size


# ----- the remote (docs/remote.md) -------------------------------------------------------------

REMOTE_ENV, CATALOG_ENV = "RAMET_REMOTE", "RAMET_CATALOG"


def remote_options(command):
    """Give ``command`` --remote and --catalog (``remote``, ``catalog``: None when not
    given)."""
    command = click.option(
        "--catalog", envvar=CATALOG_ENV, show_envvar=True, metavar="DSN",
        help="The PostgreSQL catalog of the remote: a libpq DSN (postgresql://... or "
             "key=value; empty: libpq's PG* variables and .pgpass).")(command)
    return click.option(
        "--remote", envvar=REMOTE_ENV, show_envvar=True, metavar="s3://BUCKET/PREFIX",
        help="S3-compatible object storage for published snapshots; the endpoint, region "
             "and keys come from the AWS chain (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID ...).")(
        command)


def remote_pair(remote: str | None, catalog: str | None) -> None:
    """A usage error (exit 2) unless both or neither of --remote and --catalog are given."""
    if (remote is None) != (catalog is None):
        raise click.UsageError("--remote and --catalog go together (or $RAMET_REMOTE and "
                               "$RAMET_CATALOG).")


def open_remote(remote: str | None, catalog: str | None):
    """The :class:`rametfs.store.remote.Remote` both name; a usage error without them."""
    remote_pair(remote, catalog)
    if remote is None:
        raise click.UsageError("give --remote and --catalog (or $RAMET_REMOTE and "
                               "$RAMET_CATALOG).")
    from rametfs.store.remote import Remote
    return Remote(remote, catalog)


def remote_flag(command):
    """Give ``command`` --remote (a flag: act on the catalog, not on a mount; ``remote``)
    and --catalog, besides -m/--mount, --data and --mode (``**where``, for the local
    command)."""
    for option in reversed(_RAMET_OPTIONS):
        command = option(command)
    command = click.option("--catalog", envvar=CATALOG_ENV, show_envvar=True, metavar="DSN",
                           help="With --remote: the catalog (a libpq DSN).")(command)
    return click.option("--remote", "remote", is_flag=True,
                        help="Act on the remote's catalog --catalog names (docs/remote.md), "
                             "not on a mount.")(command)


@contextlib.contextmanager
def remote_catalog(catalog: str | None, command: str) -> Iterator:
    """The :class:`rametfs.store.remote_catalog.Catalog` --catalog names, closed after; its
    errors become exit codes, the message prefixed with ``command``."""
    from rametfs import errors
    from rametfs.store.remote_catalog import Catalog
    if catalog is None:
        raise click.UsageError(f"{command} --remote needs --catalog (or ${CATALOG_ENV}).")
    cat = Catalog(catalog, None)
    try:
        yield cat
    except errors.RametError as exc:
        raise RametError(exc.errno, f"{command} --remote: {exc}") from None
    finally:
        cat.close()


def published_id(cat, ref: str) -> bytes:
    """The id of the published snapshot ``ref`` names (an id, a unique prefix, a name of the
    catalog); NotFound (ENOENT) otherwise."""
    from rametfs import errors
    found = cat.snapshot(ref)
    if len(found) != 1:
        raise errors.NotFound(f"no published snapshot {ref!r}" if not found
                              else f"snapshot prefix {ref!r} is ambiguous")
    return found[0][0]


@main.command()
@click.argument("snapshot")
@click.option("--data", required=True, type=click.Path(file_okay=False),
              help="The data directory holding the snapshot (a daemon may serve it).")
@remote_options
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def publish(snapshot: str, data: str, remote: str | None, catalog: str | None,
            as_json: bool) -> None:
    """Publish SNAPSHOT of the store in --data to the remote: upload what the remote lacks in
    pack objects, then list it in the catalog (once every object it needs is stored).

    Idempotent, and resumable: run it again after a failure and it uploads only the rest.
    Progress on stderr, one line per pack.
    """
    from rametfs.store import Store
    from rametfs.store.publish import publish as publish_snapshot
    where = open_remote(remote, catalog)

    def progress(p) -> None:
        click.echo(f"rametfs: publish {p.snapshot[:12]}: {p.packs} packs, "
                   f"{human_bytes(p.bytes)}, {p.seconds:.1f} s", err=True)
    try:
        store = Store.open_read_only(data)
        try:
            done = publish_snapshot(store, where, snapshot, progress)
        finally:
            store.close()
    except RametError as exc:
        raise RametError(exc.errno, f"publish: {exc}") from None
    finally:
        where.close()
    if as_json:
        click.echo(json.dumps(done.to_json(), indent=2, sort_keys=True))
    elif done.already:
        click.echo(f"{done.snapshot} was published already")
    else:
        click.echo(f"{done.snapshot} published: {done.packs} packs, {done.trees} trees, "
                   f"{done.contents} contents, {done.chunks} chunks, {human_bytes(done.bytes)}, "
                   f"{done.requests} requests, {done.seconds:.1f} s")


def list_remote(catalog: str | None, as_json: bool) -> None:
    """``rametfs ls --remote``: the snapshots the catalog lists."""
    from rametfs.store import Store
    from rametfs.store.remote_catalog import Catalog
    if catalog is None:
        raise click.UsageError("ls --remote needs --catalog (or $RAMET_CATALOG).")
    cat = Catalog(catalog, None)
    try:
        names: dict[str, list[str]] = {}
        for name, sid in cat.names().items():
            names.setdefault(sid, []).append(name)
        snaps = [{**Store._snapshot(sid, value).to_json(), "names": names.get(sid.hex(), [])}
                 for sid, value in cat.snapshots()]
    finally:
        cat.close()
    if as_json:
        click.echo(json.dumps({"remote": cat.recorded_remote, "snapshots": snaps}, indent=2,
                              sort_keys=True))
        return
    now = time.time_ns()
    click.echo(f"remote: {cat.recorded_remote or '-'}  catalog: {cat.where}")
    click.echo()
    click.echo(format_table(
        ("SNAPSHOT", "TREE", "NAMES", "LABEL", "FILES", "BYTES", "AGE"),
        [(s["id"][:12], s["tree"][:12], ",".join(s["names"]) or "-",
          printable(s["label"] or ""), str(s.get("files", "-")),
          human_bytes(s["bytes"]) if "bytes" in s else "-", human_age(now - s["created_ns"]))
         for s in snaps]))


# ----- daemon lifecycle -----------------------------------------------------------------------

def _fsname_value(value: str) -> str:
    """``--fsname``: one mount option's value, so no comma, blank or backslash."""
    if not value or set(value) & set(", \t\n\\"):
        raise click.BadParameter(f"{value!r}: a name without commas, blanks or backslashes")
    return value


@main.command(name="mount")
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--data", required=True, type=click.Path(file_okay=False),
              help="Data directory: the store and execution state (created 0700).")
@click.option("--background", is_flag=True,
              help="Detach, and return once the mount answers.")
@click.option("--allow-other", is_flag=True,
              help="Let other users see the mount (a sandbox's uid: rametfs.sandbox).")
@click.option("--allow-devices", is_flag=True,
              help="Mount without nodev: device nodes in executions open their devices "
                   "(root only; a risk for sandboxes: docs/security.md).")
@click.option("--allow-suid", is_flag=True,
              help="Mount without nosuid: set-user-ID and set-group-ID files run with their "
                   "owner's ids (root only; a risk for sandboxes: docs/security.md).")
@click.option("--fsname", default="rametfs", show_default=True, metavar="NAME",
              callback=lambda ctx, param, value: _fsname_value(value),
              help="The mount's source in the mount table (df, findmnt): a suite that finds "
                   "its mount by device name (fstests) names it.")
@click.option("--debug", is_flag=True, help="Debug logging, and FUSE debug output.")
@click.option("--log", "log_file", type=click.Path(dir_okay=False),
              help="Log to this file (default: stderr; with --background <DATA>/daemon.log).")
@click.option("--max-file-size", type=ByteSize(1), metavar="BYTES",
              help="A file may not grow past this size: EFBIG (default: ext4's limit, "
                   "16 TiB - 4 KiB).")
@click.option("--cache-max-bytes", type=ByteSize(0), metavar="BYTES",
              help="Disk the hydration cache may take; unused content goes first (default: "
                   "a quarter of the data directory's file system).")
@click.option("--max-answer-bytes", type=ByteSize(4096), metavar="BYTES",
              help="The longest answer of a control file: a diff, preview or reply past it "
                   "is EFBIG, an fsmonitor answer says \"everything\" (default: 64 MiB).")
@click.option("--allocator", "allocator_choice", type=click.Choice(allocator.CHOICES),
              default="auto", show_default=True,
              help="The daemon's memory allocator: jemalloc gives a reset execution's memory "
                   "back to the system (auto: jemalloc when installed, else Python's own).")
@click.option("--faults", is_flag=True, hidden=True,
              help="Take the fault command (fault injection, for the test suite).")
@remote_options
def mount(mountpoint: str, data: str, background: bool, allow_other: bool,
          allow_devices: bool, allow_suid: bool, fsname: str, debug: bool,
          log_file: str | None, max_file_size: int | None, cache_max_bytes: int | None,
          max_answer_bytes: int | None, allocator_choice: str, faults: bool,
          remote: str | None, catalog: str | None) -> None:
    """Mount rametfs at MOUNTPOINT (made if missing) and serve it until unmounted.

    Stop it with `rametfs umount MOUNTPOINT`.  Without the patched pyfuse3 it runs in plain
    mode, and says so on stderr (rametfs build-pyfuse3).  With --remote and --catalog, a
    published snapshot is found there and fetched as it is read (docs/remote.md).
    """
    data = os.path.abspath(data)
    remote_pair(remote, catalog)
    with contextlib.suppress(OSError):  # a file there, or a dead mount: the check says so
        os.makedirs(mountpoint, exist_ok=True)  # as mkdir -p
    mountpoint = os.path.realpath(mountpoint)
    mounts.check_mount_options(allow_devices, allow_suid)  # here, not in the daemon's log
    mounts.check_can_serve(data, mountpoint)
    if background:
        os.makedirs(data, mode=0o700, exist_ok=True)
        log_file = os.path.join(data, "daemon.log") if log_file is None else log_file
    if log_file is not None:
        log_file = os.path.abspath(log_file)
    if background or allocator.MARK_ENV not in os.environ:
        # The daemon's interpreter starts with its allocator: a detached one, or this one
        # again in its place.
        argv = [sys.executable, "-m", "rametfs", "mount", "--data", data, mountpoint]
        argv += ["--log", log_file] * (log_file is not None) + ["--allow-other"] * allow_other \
            + ["--allow-devices"] * allow_devices + ["--allow-suid"] * allow_suid \
            + ["--debug"] * debug + ["--faults"] * faults + ["--fsname", fsname]
        for flag, value in (("--max-file-size", max_file_size),
                            ("--cache-max-bytes", cache_max_bytes),
                            ("--max-answer-bytes", max_answer_bytes)):
            argv += [flag, str(value)] if value is not None else []
        env = allocator.daemon_environment(os.environ, allocator_choice)
        if remote is not None:  # by the environment: a DSN may hold a password
            env.update({REMOTE_ENV: remote, CATALOG_ENV: catalog})
        if background:
            if not _start_detached(argv, env, mountpoint, log_file)["open_less"]:
                _say_plain_mode()
            return
        os.chdir("/")  # as _start_detached: no rametfs/ of the working directory imported
        os.execve(sys.executable, argv, env)
    # Imported here: the daemon needs pyfuse3, which nothing else in the CLI does.
    from rametfs.daemon import run_daemon
    if log_file and not _is_stderr(log_file):  # else the log, this stderr, says it
        _say_plain_mode()
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO, filename=log_file,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_daemon(data, mountpoint, allow_other=allow_other, debug=debug,
               max_file_size=max_file_size, cache_max_bytes=cache_max_bytes,
               max_answer_bytes=max_answer_bytes, faults=faults,
               allow_devices=allow_devices, allow_suid=allow_suid, fsname=fsname,
               remote=remote, catalog=catalog)


main.add_command(click.Command("serve", callback=mount.callback, params=mount.params,
                               help="The same as mount (its older name).",
                               short_help="The same as mount."))


def _say_plain_mode() -> None:
    """Say on stderr, in one line, that the daemon runs in plain mode, if it does: what is
    slower and the command that fixes it."""
    from rametfs.daemon import PLAIN_MODE_NOTE, plain_mode_reason  # (it imports pyfuse3)
    reason = plain_mode_reason()
    if reason is not None:
        click.echo(f"rametfs: {PLAIN_MODE_NOTE.format(reason=reason)}", err=True)


def _is_stderr(path: str | None) -> bool:
    """Whether this process's stderr is the file at ``path`` (a detached daemon's log)."""
    try:
        out, there = os.fstat(2), os.stat(path) if path else None
    except OSError:
        return False
    return there is not None and (out.st_dev, out.st_ino) == (there.st_dev, there.st_ino)


def _start_detached(argv: list[str], env: dict[str, str], mountpoint: str,
                    log_file: str) -> dict:
    """Start the daemon in its own session; return its root status once the mount answers
    with its pid.

    Raises RametError when the daemon exits first or is not ready within WAIT_SECONDS
    (then it is terminated); either way the tail of its log is in the message.
    """
    with open(log_file, "ab") as log:
        start = log.tell()  # show only what this run logs
        # cwd /: "python -m" puts the working directory first on the import path, and a
        # rametfs/ there must not be what runs.
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                 start_new_session=True, cwd="/", env=env)
    deadline = time.monotonic() + WAIT_SECONDS
    while child.poll() is None:
        status = _ready(mountpoint, child.pid) if os.path.ismount(mountpoint) else None
        if status is not None:
            return status
        if time.monotonic() > deadline:
            child.terminate()
            child.wait()
            raise RametError(errno.ETIMEDOUT, f"daemon not ready after {WAIT_SECONDS:.0f} s; "
                             f"{log_file} ends with:\n{_tail(log_file, start)}")
        time.sleep(_POLL_SECONDS)
    err = {code: e for e, code in EXIT_CODES.items()}.get(child.returncode, errno.EIO)
    raise RametError(err, f"daemon exited with status {child.returncode}; "
                     f"{log_file} ends with:\n{_tail(log_file, start)}")


def _ready(mountpoint: str, pid: int) -> dict | None:
    """The mount's root status if it is daemon ``pid``'s (another daemon may be mounted
    there: the new one then exits) and its bind of ``snapshots/`` is settled, else None."""
    try:
        with open(os.path.join(mountpoint, protocol.CONTROL_DIR, protocol.STATUS)) as f:
            status = json.load(f)
        ready = status["pid"] == pid and status["snapshots_bind"] != "pending"
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return status if ready else None


def _tail(path: str, start: int, lines: int = 20) -> str:
    """The last ``lines`` lines of ``path`` after byte offset ``start``."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


@main.command()
@click.argument("mountpoint", required=False, type=click.Path(file_okay=False))
@click.option("--lazy", is_flag=True,
              help="Detach now even if the mount is busy (-z); the daemon exits once the last "
                   "process using it lets go.")
@click.option("--force", is_flag=True,
              help="Then end the daemon's FUSE connection if it still serves: copies of the "
                   "mount in other mount namespaces (sandboxes, unshare -m) or a lazily "
                   "detached mount in use (their processes get ENOTCONN).  Needs root.")
def umount(mountpoint: str | None, lazy: bool, force: bool) -> None:
    """Unmount MOUNTPOINT (default $RAMET_MOUNT); wait for its daemon to exit.

    When it returns, the daemon has flushed its state; with --lazy (and no --force) it
    returns once the mount is detached, and the daemon exits when the last process using the
    mount lets go.  Without --lazy the read-only bind
    of snapshots/ goes first (it would keep the mount busy) and comes back if the mount is
    busy; a busy mount (exit 5) is named with the processes using it, as fuser -m finds
    them.  Commands running on executions are cancelled first (their callers get
    ECANCELED).  A copy of the mount made in another mount namespace while it existed (a
    sandbox, unshare -m, xfstests' check) keeps the daemon serving it, and holding its data
    directory, after the mount here is gone: umount then names those namespaces' processes
    and exits 5, and --force (given again, or at first) ends the daemon's FUSE connection.
    Only a rametfs mount is unmounted (else ENOTCONN); the bind itself and binds of the
    mount or of its executions made elsewhere are refused (EINVAL).
    """
    mountpoint = mountpoint or os.environ.get(MOUNT_ENV)
    if not mountpoint:
        raise click.UsageError(f"Missing argument 'MOUNTPOINT' (or ${MOUNT_ENV}).")
    mountpoint = os.path.realpath(mountpoint)
    top = mounts.mount_at(mountpoint)
    if top is None or top.fstype != mounts.FSTYPE:
        _end_copies(mountpoint, force)
        return
    parent = os.path.dirname(mountpoint)
    if os.path.basename(mountpoint) == protocol.SNAPSHOTS_DIR and mounts.snapshots_bound(parent):
        raise RametError(errno.EINVAL, f"{mountpoint} is the read-only bind of snapshots/ of "
                         f"the rametfs mount at {parent}, and goes with it")
    if top.root != "/":
        raise RametError(errno.EINVAL, f"{mountpoint} is a bind of {top.root} of a rametfs "
                         f"mount, not where a daemon mounted it; remove it with umount "
                         f"{mountpoint}")
    try:
        status = Ramet(mountpoint, mode="fuse").status()
    except NotMountedError:
        status = None  # no daemon answers, but a crashed one's mount may still need removing
    if status is not None and status.get("mount") != mountpoint:
        raise RametError(errno.EINVAL, f"{mountpoint} is a bind of (part of) a rametfs mount, "
                         f"not where a daemon mounted it; remove it with umount -R {mountpoint}")
    pid = status["pid"] if status is not None else None
    dead = "" if pid is not None else " (no daemon answers there: --lazy detaches it)"
    cancelled = []
    if pid is not None:  # a long command would keep its caller, and so the mount, busy
        with contextlib.suppress(RametError):  # another user's mount: its root ctl is 0600
            cancelled = Ramet(mountpoint, mode="fuse").cancel()
    bound = not lazy and mounts.snapshots_bound(mountpoint)
    if bound:
        try:
            mounts.unbind_snapshots(mountpoint)
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise RametError(exc.errno, f"{exc.filename}: {exc.strerror}{dead}") from None
            raise RametError(errno.EBUSY, _busy(mountpoint, pid)) from None
    argv = ["fusermount3", "-u", *(["-z"] * lazy), mountpoint]
    done = subprocess.run(argv, capture_output=True, text=True)
    deadline = time.monotonic() + CANCELLED_GRACE_S
    while cancelled and "busy" in done.stderr and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)  # the callers of cancelled commands closing their files
        done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        why = done.stderr.strip() or f"{' '.join(argv)} failed"
        if "busy" in done.stderr:
            why = _busy(mountpoint, pid)
        if bound and pid is not None:
            failure = mounts.bind_snapshots_read_only(mountpoint)
            if failure is not None:
                why += f"; and snapshots/ is no longer read-only: {failure}"
        if "busy" in done.stderr:
            raise RametError(errno.EBUSY, why)
        if pid is None:
            raise NotMountedError(mountpoint)
        raise RametError(errno.EIO, why)
    if pid is not None and lazy and not force:
        click.echo(f"detached {mountpoint}; its daemon (pid {pid}) exits once the last "
                   f"process using it lets go", err=True)
    elif pid is not None:
        _wait_for_daemon(pid, top.dev, mountpoint, force)


COPIES_GRACE_S = 5.0  # copies of the mount elsewhere may go this long before umount says so
_COPIES_POLL_S = 0.25  # how often the other mount namespaces are looked at


def _wait_for_daemon(pid: int, dev: str, mountpoint: str, force: bool) -> None:
    """Wait until daemon ``pid`` of the FUSE connection ``dev``, unmounted here, exits.

    Copies of the mount in other mount namespaces keep it serving: those that outlive
    COPIES_GRACE_S (a sandbox's command that ends goes sooner) are named, EBUSY; with
    ``force`` the connection is ended at once for them, or after CANCELLED_GRACE_S for a
    lazily detached mount still in use.  ETIMEDOUT after WAIT_SECONDS."""
    start = time.monotonic()
    copies_since, aborted = None, False
    while not _exited(pid, _COPIES_POLL_S):
        now = time.monotonic()
        copies = mounts.copies_elsewhere(dev=dev)
        if force and not aborted and (copies or now - start > CANCELLED_GRACE_S):
            _abort(dev)
            aborted = True
        elif copies and not aborted:
            copies_since = copies_since or now
            if now - copies_since > COPIES_GRACE_S:
                raise RametError(errno.EBUSY, f"unmounted {mountpoint} here, but its daemon "
                                 f"(pid {pid}) goes on serving copies of the mount, and "
                                 f"holding its data directory, in "
                                 f"{'; '.join(map(str, copies))}: end those processes, or "
                                 f"rametfs umount --force {mountpoint} ends its FUSE "
                                 f"connection")
        else:
            copies_since = None
        if now - start > WAIT_SECONDS:
            raise RametError(errno.ETIMEDOUT, f"unmounted, but daemon pid {pid} still runs "
                             f"after {WAIT_SECONDS:.0f} s (--force ends its FUSE connection)")


MAX_USERS_SHOWN = 8  # processes named in a busy unmount's message


def _busy(mountpoint: str, pid: int | None) -> str:
    """Why the mount at ``mountpoint`` (served by daemon ``pid``, None: none answers) is
    busy: the processes using it, and what to do."""
    users = mounts.users(mountpoint)
    held = "; ".join(map(str, users[:MAX_USERS_SHOWN])) \
        + (f"; and {len(users) - MAX_USERS_SHOWN} more" if len(users) > MAX_USERS_SHOWN else "")
    where = f": used by {held}" if users else " (by no process of this mount namespace: a " \
        "mount inside it, or a copy of it busy in another namespace)"
    then = "no daemon answers there" if pid is None else \
        "its daemon exits once the last lets go"
    return (f"{mountpoint} is busy{where}; end those or leave the mount, or rametfs umount "
            f"--lazy {mountpoint} detaches it now ({then})")


def _end_copies(mountpoint: str, force: bool) -> None:
    """``umount`` of a path no rametfs is mounted at here: ENOTCONN, unless copies of a
    rametfs mount made there live on in other mount namespaces (EBUSY naming them; with
    ``force`` their FUSE connection is ended)."""
    copies = mounts.copies_elsewhere(point=mountpoint)
    served = mounts.served_by(mountpoint)
    if not copies and served is not None:  # copies of its executions only (sandboxes' binds)
        copies = mounts.copies_elsewhere(dev=served[1])
    if not copies:
        raise NotMountedError(mountpoint)
    if not force:
        raise RametError(errno.EBUSY, f"no rametfs is mounted at {mountpoint} here, but copies "
                         f"of one live on in {'; '.join(map(str, copies))}, and its daemon "
                         f"serves them: end those processes, or rametfs umount --force "
                         f"{mountpoint} ends its FUSE connection")
    daemons = {served[0]} if served is not None else set()
    for copy in copies:  # its daemon's pid, from the copy's status: seen through its root
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            path = f"/proc/{copy.pids[0]}/root{copy.mounts[0].point}"
            with open(os.path.join(path, protocol.CONTROL_DIR, protocol.STATUS)) as f:
                daemons.add(json.load(f)["pid"])
    for dev in sorted({m.dev for copy in copies for m in copy.mounts}):
        _abort(dev)
    for pid in daemons:
        if not _exited(pid, WAIT_SECONDS):
            raise RametError(errno.ETIMEDOUT, f"ended its FUSE connection, but daemon pid "
                             f"{pid} still runs after {WAIT_SECONDS:.0f} s")


def _abort(dev: str) -> None:
    try:
        mounts.abort_connection(dev)
    except OSError as exc:
        raise RametError(exc.errno or errno.EIO, f"cannot end FUSE connection {dev}: "
                         f"{exc.strerror} (--force needs root: it writes to fusectl's abort "
                         f"file)") from None


def _exited(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` has exited, waiting up to ``seconds`` for it."""
    deadline = time.monotonic() + seconds
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting for its parent has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@main.command(name="build-pyfuse3")
def build_pyfuse3() -> None:
    """Build pyfuse3 with the open-less patch into this Python (about a minute).

    What a plain `pip install` of rametfs lacks (pip builds pyfuse3 from its own source):
    with it the daemon runs in open-less mode, where the kernel caches file pages and
    directory listings (warm git status 5-10x faster, cold 2x).  Needs a C compiler,
    Python's and libfuse3's headers (Debian: gcc python3-dev libfuse3-dev pkg-config) and
    the package index.  A running daemon keeps its pyfuse3 until it is mounted again.
    """
    from rametfs import pyfuse3_build
    try:
        seconds = pyfuse3_build.build(
            sys.executable, lambda line: click.echo(f"rametfs: pyfuse3: {line}", err=True))
    except pyfuse3_build.BuildError as exc:
        raise RametError(errno.EIO, f"pyfuse3: {exc}") from None
    click.echo(f"rametfs: pyfuse3: installed with the open-less patch in {seconds:.0f} s; "
               "mount again to use it", err=True)


# ----- snapshots and executions --------------------------------------------------------------

@main.command()
@click.option("--data", metavar="DIR",
              help="Data directory to check (a live daemon may be serving it).")
@remote_options
def fsck(data: str | None, remote: str | None, catalog: str | None) -> None:
    """Verify every snapshot (trees, contents and each chunk's BLAKE3 id) and every execution's
    layer (its dentries, links, page maps and orphans against its records).  Exit 1 on damage.

    Reads only: nothing in DIR is made or changed.  A DIR that holds no store is refused
    (exit 3, ENOENT; not a directory: exit 4, EINVAL).  With --remote and --catalog instead:
    every published snapshot has its trees and content records published and matching their
    ids, its chunks published, in packs the object store holds (docs/remote.md).
    """
    if remote is not None or catalog is not None:
        return fsck_remote(remote, catalog)
    if data is None:
        raise click.UsageError("give --data DIR, or --remote and --catalog.")
    from rametfs.store import Store, fsck as check_store
    try:
        store = Store.open_read_only(data)
    except RametError as exc:
        raise RametError(exc.errno, f"fsck: {exc}") from None
    try:
        report = check_store(store)
    finally:
        store.close()
    for line in report.problems:
        click.echo(line)
    click.echo(f"{report.snapshots} snapshots, {report.trees} trees, {report.contents} contents, "
               f"{report.chunks} chunks, {report.executions} executions' layers "
               f"({report.upper_inodes} upper inodes, {len(report.orphans)} orphans; "
               f"{len(report.dead_layers)} dead layers to delete) checked; "
               f"{len(report.problems)} problems", err=True)
    if report.problems:
        raise click.exceptions.Exit(EXIT_OTHER)


def fsck_remote(remote: str | None, catalog: str | None) -> None:
    from rametfs.store.remote_fsck import check
    where = open_remote(remote, catalog)
    try:
        report = check(where)
    except RametError as exc:
        raise RametError(exc.errno, f"fsck: {exc}") from None
    finally:
        where.close()
    for line in report.problems:
        click.echo(line)
    click.echo(f"{report.snapshots} published snapshots, {report.trees} trees, "
               f"{report.contents} contents, {report.chunks} chunks, {report.packs} packs "
               f"checked; {len(report.problems)} problems", err=True)
    if report.problems:
        raise click.exceptions.Exit(EXIT_OTHER)


@main.command()
@click.argument("source", type=click.Path(file_okay=False))
@label_option
@message_option
@click.option("--git", "git", is_flag=True,
              help="SOURCE is a git repository: import a revision's tree from its objects.")
@click.option("--rev", metavar="REV", help="With --git: the revision to import (default HEAD).")
@click.option("--with-git-dir", is_flag=True,
              help="With --git: take the repository's .git directory along (local commits, "
                   "branches, stash, index).")
@click.option("--on-change", type=click.Choice(protocol.ON_CHANGE),
              help="An entry that changes while it is imported: fail the import (the "
                   "default, EAGAIN) or skip it (counted in the snapshot's stats).")
@ramet_options
def snapshot(ramet: Ramet, source: str, label: str | None, message: str | None, git: bool,
             rev: str | None, with_git_dir: bool, on_change: str | None) -> None:
    """Import the directory SOURCE as a snapshot; print its id."""
    if not git and (rev or with_git_dir):
        raise click.UsageError("--rev and --with-git-dir need --git.")
    if git and on_change:
        raise click.UsageError("--on-change is for a directory, not --git.")
    with _elapsed(f"snapshot {source}"):
        if git:
            snapshot_id = ramet.snapshot_git(source, rev=rev, with_git_dir=with_git_dir,
                                             label=label, message=message)
        else:
            snapshot_id = ramet.snapshot(source, label=label, message=message,
                                         on_change=on_change)
    click.echo(snapshot_id)


def _octal(ctx: click.Context, param: click.Parameter, text: str | None) -> int | None:
    """An octal mode option's value as an int (None when not given); a usage error (exit 2)
    for text that is not octal."""
    if text is None:
        return None
    try:
        return int(text, 8)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an octal mode such as 0750") from None


def _name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An execution id given with --name: not empty (EINVAL, exit 4)."""
    if value == "":
        raise RametError(errno.EINVAL, "--name '': an execution id is at least one character "
                         f"(it must match {protocol.EXECUTION_NAME_RE.pattern}); leave --name "
                         "out for a generated one")
    return value


name_option = click.option("--name", callback=_name,
                           help="Execution id to use (default: generated; EEXIST, exit 8, "
                                "when taken).")


_ACCESS_OPTIONS = (
    click.option("--owner", type=click.IntRange(0), metavar="UID",
                 help="The uid it belongs to (default: the daemon's)."),
    click.option("--group", type=click.IntRange(0), metavar="GID",
                 help="Its group, for --share's group bits (default: the daemon's gid)."),
    click.option("--share", metavar="MODE", callback=_octal,
                 help="Its permission bits, like a directory's (default 0700: the owner "
                      "alone)."),
    click.option("--control", type=click.Choice(protocol.CONTROLS),
                 help="What its own .ramet files allow: full (default), read (no writes) or "
                      "none (no .ramet)."),
    click.option("--max-bytes", type=ByteSize(1), metavar="BYTES",
                 help="Disk its written data may take, e.g. 10G (EDQUOT past it; default: no "
                      "limit)."),
    click.option("--max-inodes", type=click.IntRange(1, 2**63 - 1), metavar="N",
                 help="Upper inodes it may hold, copies-up included (EDQUOT past it)."),
)


def access_options(command):
    """Give ``command`` the access settings and limits of ``create`` (docs/security.md)."""
    for option in reversed(_ACCESS_OPTIONS):
        command = option(command)
    return command


@main.command()
@click.argument("snapshot")
@name_option
@access_options
@policy_option("none")
@ramet_options
def create(ramet: Ramet, snapshot: str, name: str | None, owner: int | None, group: int | None,
           share: int | None, control: str | None, max_bytes: int | None,
           max_inodes: int | None, policy: str | None) -> None:
    """Create an execution of SNAPSHOT; print its id.

    SNAPSHOT is an id as `snapshot` prints it (64 hex digits) or `ls` shows it (12), or
    any unique prefix of at least 8 hex digits.  --policy is stored with the execution: its
    promotes and previews apply it unless given another.  The harness acts on it through
    the root control file whatever its --control.  Past --max-bytes or --max-inodes a write
    fails EDQUOT; --owner, --group and --share decide who may enter it and use its .ramet
    files (EACCES for the others; docs/security.md).
    """
    click.echo(ramet.create(snapshot, name=name, policy=policy, owner=owner, group=group,
                            share=share, control=control, max_bytes=max_bytes,
                            max_inodes=max_inodes).id)



@main.command()
@execution_argument
@label_option
@message_option
@policy_option("the policy stored with the execution at create, else none")
@click.option("--publish", is_flag=True,
              help="Then publish the snapshot to the daemon's remote (mount --remote; "
                   "docs/remote.md).")
@ramet_options
def promote(ramet: Ramet, execution: str, label: str | None, message: str | None,
            policy: str | None, publish: bool) -> None:
    """Snapshot EXECUTION and make it its head (reset returns to it); print the id.

    A policy (--policy, else the one stored at create) leaves out ephemeral paths, stores
    rebuildable ones as recipes and checks shared ones against the base.  The tree's own
    ramet.toml applies only with --policy tree.
    """
    click.echo(target(ramet, execution).promote(label=label, message=message, policy=policy,
                                                publish=publish))


@main.command()
@execution_argument
@label_option
@message_option
@policy_option("none")
@ramet_options
def checkpoint(ramet: Ramet, execution: str, label: str | None, message: str | None,
               policy: str | None) -> None:
    """Snapshot EXECUTION, keeping its head; print the id (everything, unless --policy)."""
    click.echo(target(ramet, execution).checkpoint(label=label, message=message,
                                                   policy=policy))


@main.command()
@execution_argument
@policy_option("as promote")
@click.option("--json", "as_json", is_flag=True, help="Print the preview as JSON.")
@ramet_options
def preview(ramet: Ramet, execution: str, policy: str | None, as_json: bool) -> None:
    """Print what a promote of EXECUTION would keep: class, bytes and path, then totals.

    Changes nothing.  Exit 4 (EINVAL) when the promote would be stopped.
    """
    report = target(ramet, execution).preview(policy=policy)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        for item in report["paths"]:
            recipe = f"  (recipe {item['recipe']})" if "recipe" in item else ""
            click.echo(f"{item['class']:<11} {item['bytes']:>12} "
                       f"{quote_path(os.fsencode(item['path']))}{recipe}")
        click.echo()
        click.echo(format_table(("CLASS", "PATHS", "FILES", "BYTES"), [
            (cls, str(t["paths"]), str(t["files"]), human_bytes(t["bytes"]))
            for cls, t in ((c, report["totals"][c]) for c in CLASSES)]))
        for problem in report["problems"]:
            click.echo(f"rametfs: would stop the promote: {printable(problem)}", err=True)
    if report["problems"]:
        raise click.exceptions.Exit(exit_code(errno.EINVAL))


@main.command()
@click.argument("snapshot")
@name_option
@click.option("--runtime", type=click.Choice(["bubblewrap", "docker", "host"]),
              help="Where the recipes run (default: the sandbox the snapshot recorded; "
                   "host runs them unsandboxed, as this user).")
@click.option("--image", help="With --runtime docker: the image (default: the recorded one).")
@ramet_options
def restore(ramet: Ramet, snapshot: str, name: str | None, runtime: str | None,
            image: str | None) -> None:
    """Create an execution of SNAPSHOT and rebuild its recipes; print the execution id.

    Each step (inputs checked, command, readiness check) is reported on stderr as it ends.
    On failure the execution is kept for inspection.  Without --runtime, a snapshot whose
    recipes record no sandbox is refused (exit 4).
    """
    if image is not None:
        if runtime != "docker":
            raise click.UsageError("--image needs --runtime docker.")
        from rametfs.sandbox import Docker  # only here: the sandboxes are harness side
        runtime = Docker(image)
    try:
        restored = ramet.restore(
            snapshot, runtime=runtime, name=name,
            on_step=lambda step: click.echo(printable(str(step), lines=True), err=True))
    except RestoreError as exc:
        click.echo(exc.execution.id)
        raise
    click.echo(restored.execution.id)


@main.command()
@execution_argument
@click.option("--base", "to_base", is_flag=True,
              help="Go back to the snapshot EXECUTION was created from instead.")
@click.option("--to", metavar="SNAPSHOT",
              help="Rebase EXECUTION onto SNAPSHOT instead (id or unique prefix; the "
                   "harness's: EACCES from inside a sandbox).")
@ramet_options
def reset(ramet: Ramet, execution: str, to_base: bool, to: str | None) -> None:
    """Drop every change in EXECUTION since its head; print the head's id.

    The head is its last promote, else the snapshot it was created from (its base).  With
    --base or --to, that snapshot becomes its head: diff, verify and the next promote refer
    to it.  O(1) in FUSE mode, whatever the snapshot.
    """
    if to_base and to is not None:
        raise click.UsageError("--base and --to name two snapshots; give one.")
    click.echo(target(ramet, execution).reset(to=to, base=to_base))


@main.command()
@click.argument("execution")
@ramet_options
def release(ramet: Ramet, execution: str) -> None:
    """Drop EXECUTION and its changes.

    A pool member leaves its pool, which shrinks by one; a leased one is refused (exit 5)
    until its holder gives it back or its lease expires (rametfs ls shows when).
    """
    try:
        ramet.release(execution)
    except RametError as exc:
        lease = exc.errno == errno.EBUSY and next(
            (e.get("lease") for e in ramet.executions() if e["id"] == execution), None)
        if not lease:
            raise
        left = human_age(lease["expires_ns"] - time.time_ns())
        raise RametError(errno.EBUSY, f"execution {execution!r} is leased by "
                         f"{lease_holder(lease)}, whose ExecutionPool.acquire() block "
                         f"gives it back when it ends; else the lease expires in {left} and "
                         f"the daemon returns it to its pool: release it then") from None


# ----- pools and leases (docs/protocol.md; rametfs ls shows their state and lease holders) ----

HOLDER_ENV = "RAMET_HOLDER"
holder_option = click.option(
    "--holder", required=True, envvar=HOLDER_ENV, show_envvar=True,
    help="The lease holder: a token you choose, given again to renew and return.")
ttl_option = click.option("--ttl", type=click.FloatRange(0, 1e9, max_open=True),
                          default=DEFAULT_TTL, show_default=True, metavar="SECONDS",
                          help="How long the lease lasts unless renewed.")


@main.command()
@click.argument("snapshot")
@click.option("--size", type=click.IntRange(1, protocol.MAX_POOL_SIZE), required=True,
              help="Executions it keeps ready (leased and quarantined ones are replaced).")
@click.option("--name", help="The pool's name: reattach to it when it exists (default: a new "
                             "pool-<8 hex>).")
@access_options
@policy_option("none")
@click.option("--keep-last", type=click.IntRange(1), metavar="N",
              help="After each promote of a member, forget the pool's promotes but the N "
                   "newest and the named ones (default: keep every one).")
@ramet_options
def pool(ramet: Ramet, snapshot: str, size: int, name: str | None, owner: int | None,
         group: int | None, share: int | None, control: str | None, max_bytes: int | None,
         max_inodes: int | None, policy: str | None, keep_last: int | None) -> None:
    """Keep SIZE executions of SNAPSHOT ready to lease; print the pool's name.

    The daemon keeps the pool (fallback mode: the data directory) until `rametfs drop`.
    Every member gets the settings and policy given (those of create).  Reattaching to a pool
    with another base, settings or policy is refused (exit 8, EEXIST).
    """
    click.echo(ramet.open_pool(snapshot, size, name=name, policy=policy, owner=owner,
                               group=group, share=share, control=control,
                               max_bytes=max_bytes, max_inodes=max_inodes,
                               keep_last=keep_last)["pool"])


@main.command()
@click.argument("pool_name", metavar="POOL")
@holder_option
@ttl_option
@click.option("--pid", type=click.IntRange(0), metavar="PID",
              help="The process the lease is for, shown by rametfs ls (default: this "
                   "command's parent, e.g. the shell running it).")
@ramet_options
def acquire(ramet: Ramet, pool_name: str, holder: str, ttl: float, pid: int | None) -> None:
    """Lease the ready execution of POOL returned last; print its id.

    Answers at once: exit 5 (EBUSY) when none is ready (try again later).  Renew the lease
    before it ends (rametfs renew), or it ends and the execution goes back to the pool;
    give it back with rametfs return.
    """
    click.echo(ramet.acquire(pool_name, holder, ttl,
                             pid=os.getppid() if pid is None else pid)["execution"])


@main.command()
@click.argument("execution")
@holder_option
@ttl_option
@ramet_options
def renew(ramet: Ramet, execution: str, holder: str, ttl: float) -> None:
    """Extend HOLDER's lease on EXECUTION to TTL seconds from now.

    Exit 5 (EBUSY) when another holder has it, 4 (EINVAL) when the lease has ended (the
    execution went back to its pool).
    """
    ramet.renew(execution, holder, ttl)


@main.command(name="return")
@click.argument("execution")
@holder_option
@click.option("--deep", is_flag=True, help="Verify deeply (as verify --deep) after the reset.")
@ramet_options
def return_(ramet: Ramet, execution: str, holder: str, deep: bool) -> None:
    """Give HOLDER's leased EXECUTION back to its pool; print its state.

    It is reset to the pool's snapshot and verified: "ready" again, or "quarantined" (exit 1,
    with the reason on stderr; the pool makes a new member in its place).
    """
    reply = ramet.return_execution(execution, holder, "deep" if deep else "root")
    click.echo(reply["state"])
    if reply["state"] == "quarantined":
        reason = next((e.get("quarantine_reason") for e in ramet.executions()
                       if e["id"] == execution), None)
        click.echo(f"rametfs: execution {execution} quarantined: {printable(reason or '?')}",
                   err=True)
        raise click.exceptions.Exit(EXIT_OTHER)


@main.command()
@click.argument("pool_name", metavar="POOL")
@ramet_options
def drop(ramet: Ramet, pool_name: str) -> None:
    """Release every execution of POOL, leased ones too, and forget it; print their ids."""
    for execution in ramet.drop_pool(pool_name):
        click.echo(execution)


@main.command()
@execution_argument
@click.option("--deep", is_flag=True,
              help="Also reread the stored state and rehash every byte served from the base.")
@ramet_options
def verify(ramet: Ramet, execution: str, deep: bool) -> None:
    """Check that EXECUTION equals its head; print each difference like diff.  Exit 1 when
    it differs (a ready pool execution that differs is quarantined)."""
    differences = target(ramet, execution).verify(deep=deep)
    for status, path in differences:
        click.echo(f"{status} {quote_path(os.fsencode(path))}")
    if differences:
        raise click.exceptions.Exit(EXIT_OTHER)


@main.command()
@execution_argument
@click.option("-z", "nul", is_flag=True,
              help="End each line with NUL, and print the path's bytes unquoted.")
@ramet_options
def diff(ramet: Ramet, execution: str, nul: bool) -> None:
    """Print what changed in EXECUTION: A, M or D, then the path, one per line.

    A path is quoted as git status --porcelain quotes it (in double quotes, with C escapes
    and octal bytes, when it holds a space, a quote, a backslash, a control character or a
    byte >= 0x80); with -z, as git's -z, it is not and each record ends with NUL.
    """
    changes = target(ramet, execution).diff()
    if nul:
        click.echo(b"".join(f"{status} ".encode() + os.fsencode(path) + b"\0"
                            for status, path in changes), nl=False)
        return
    for status, path in changes:
        click.echo(f"{status} {quote_path(os.fsencode(path))}")


@main.command()
@execution_argument
@ramet_options
def status(ramet: Ramet, execution: str | None) -> None:
    """Print the daemon's status, or EXECUTION's (or the one -m names), as JSON.

    The daemon's says which mode its FUSE adapter runs in ("open_less"); in plain mode a
    line on stderr says so too.
    """
    if execution or ramet.here:
        data = target(ramet, execution).status()
    else:
        data = ramet.status()
        if ramet.mode == "fuse" and not data.get("open_less", True):
            click.echo(f"rametfs: the daemon runs in mode {fuse_mode(data)}", err=True)
    click.echo(json.dumps(data, indent=2, sort_keys=True))


@main.command(name="ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--remote", "remote", is_flag=True,
              help="List the snapshots published in the catalog --catalog names instead.")
@click.option("--catalog", envvar=CATALOG_ENV, show_envvar=True, metavar="DSN",
              help="With --remote: the catalog (a libpq DSN).")
@_RAMET_OPTIONS[0]
@_RAMET_OPTIONS[1]
@_RAMET_OPTIONS[2]
def list_(as_json: bool, remote: bool, catalog: str | None, **where) -> None:
    """List snapshots, executions and pools, after a line naming the mount and its mode
    (open-less or plain; fallback mode: the copy method and data directory); with --remote,
    the snapshots published in the catalog.

    TREE is 12 hex digits of a snapshot's root tree id: snapshots of the same directory
    tree (the same names, contents, modes, owners, times) have the same TREE.
    ACCESS is an execution's owner:group/share bits/--control; QUOTA its --max-bytes and
    --max-inodes (shown when one has some); pool members also show their state, pool,
    lease holder and lease expiry.
    """
    if remote:
        return list_remote(catalog, as_json)
    return _list_local(as_json=as_json, **where)


@ramet_options
def _list_local(ramet: Ramet, as_json: bool) -> None:
    """``rametfs ls`` of a mount or a fallback data directory."""
    state = ramet.status()
    fallback = ramet.mode == "fallback"
    if as_json:
        keys = ("snapshots", "executions", "mode") + (("copy_method",) if fallback else
                                                      ("open_less",))
        listing = {key: state[key] for key in keys if key in state}
        if state.get("pools"):
            listing["pools"] = state["pools"]
        click.echo(json.dumps(listing, indent=2, sort_keys=True))
        return
    now = time.time_ns()
    if fallback:
        click.echo(f"mode: fallback  copy method: {state['copy_method']}  data: {state['data']}")
    else:
        click.echo(f"mount: {state['mount']}  mode: {fuse_mode(state)}")
    click.echo()
    click.echo(format_table(
        ("SNAPSHOT", "TREE", "NAMES", "LABEL", "FILES", "BYTES", "AGE"),
        [(s["id"][:12], s["tree"][:12], ",".join(s.get("names", ())) or "-",
          printable(s["label"] or ""), str(s.get("files", "-")),
          human_bytes(s["bytes"]) if "bytes" in s else "-", human_age(now - s["created_ns"]))
         for s in state["snapshots"]]))
    click.echo()
    executions = state["executions"]
    pooled = any(e.get("pool") for e in executions)  # else no pool columns
    quotas = any(e.get("max_bytes") or e.get("max_inodes") for e in executions)
    click.echo(format_table(
        ("EXECUTION", "BASE", "HEAD", "UPPER", "AGE", "ACCESS") + ("QUOTA",) * quotas
        + ("STATE", "POOL", "LEASE HOLDER", "EXPIRES") * pooled,
        [(e["id"], e["base"][:12], e["head"][:12],
          "-" if e["upper_bytes"] is None else human_bytes(e["upper_bytes"]),
          human_age(now - e["created_ns"]), access_cell(e))
         + (quota_cell(e),) * quotas
         + (e["state"], e.get("pool") or "-", *lease_cells(e.get("lease"), now)) * pooled
         for e in executions]))
    if state.get("pools"):
        click.echo()
        click.echo(format_table(
            ("POOL", "BASE", "SIZE", "READY", "LEASED", "QUARANTINED"),
            [(p["name"], p["base"][:12], str(p["size"]), str(p["ready"]), str(p["leased"]),
              str(p["quarantined"])) for p in state["pools"]]))


def fuse_mode(state: dict) -> str:
    """The FUSE adapter's mode as the root status gives it, for people."""
    if state.get("open_less", True):
        return "open-less"
    return "plain (slower; see rametfs build-pyfuse3 --help)"


@main.command()
@click.argument("ref", metavar="SNAPSHOT|EXECUTION")
@ramet_options
def log(ramet: Ramet, ref: str) -> None:
    """Print SNAPSHOT and its ancestors, newest first; of an EXECUTION, its head and the
    head's ancestors, the execution's base marked "(base)" and its head "(head)".

    One line each: id, age, label, message.  An execution's id is looked up first.
    """
    now = time.time_ns()
    execution = next((e for e in ramet.executions() if e["id"] == ref), None)
    marks: dict[str, list[str]] = {}
    if execution is None:
        start = ramet.resolve(ref)
    else:
        start = execution["head"]
        for role in ("head", "base"):
            marks.setdefault(execution[role], []).append(f"({role})")
    for s in ancestry(ramet.snapshots(), start):
        click.echo(" ".join(filter(None, (s["id"], *marks.get(s["id"], ()),
                                          human_age(now - s["created_ns"]),
                                          printable(s["label"] or ""),
                                          printable(s["message"] or "")))))


@main.command(name="name")
@click.argument("name")
@click.argument("snapshot", required=False)
@click.option("--delete", is_flag=True, help="Delete the name NAME (SNAPSHOT not given).")
@remote_flag
def name_(name: str, snapshot: str | None, delete: bool, remote: bool, catalog: str | None,
          **where) -> None:
    """Point the snapshot name NAME at SNAPSHOT, or move it there (like a git branch).

    SNAPSHOT is an id, a unique prefix of at least 8 hex digits, or a name; from then on
    every command that takes a snapshot takes NAME.  A name follows git's ref rules and is
    never 8 or more hex digits alone (docs/lifecycle.md).  Prints the id it points at.

    With --remote, the name is the catalog's, seen by every worker served with that
    remote: SNAPSHOT is a published snapshot (id, prefix or catalog name), and the mount's
    own names are left as they are (a worker's own name of the same spelling comes first
    there).  docs/remote.md.
    """
    if delete == (snapshot is not None):
        raise click.UsageError("give NAME SNAPSHOT, or --delete NAME")
    if remote:
        return _name_remote(name, snapshot, catalog)
    return _name_local(name=name, snapshot=snapshot, delete=delete, **where)


def _name_remote(name: str, snapshot: str | None, catalog: str | None) -> None:
    """``rametfs name --remote``."""
    from rametfs.store.names import check_name
    with remote_catalog(catalog, "name") as cat:
        if snapshot is None:
            click.echo(f"deleted published name {name} (was {cat.delete_name(name)})")
            return
        check_name(name)
        sid = published_id(cat, snapshot)
        previous = cat.set_name(name, sid)
    moved = f" (was {previous})" if previous not in (None, sid.hex()) else ""
    click.echo(f"{name} -> {sid.hex()}{moved}")


@ramet_options
def _name_local(ramet: Ramet, name: str, snapshot: str | None, delete: bool) -> None:
    if delete:
        click.echo(f"deleted name {name} (was {ramet.unname(name)})")
        return
    reply = ramet.name(name, snapshot)
    moved = f" (was {reply['previous']})" if reply["previous"] not in (None, reply["snapshot"]) \
        else ""
    click.echo(f"{name} -> {reply['snapshot']}{moved}")


@main.command()
@click.argument("snapshots", metavar="SNAPSHOT...", nargs=-1, required=True)
@click.option("--force", is_flag=True,
              help="Delete the names pointing at them and detach the executions whose head "
                   "they are.")
@remote_flag
def rm(snapshots: tuple[str, ...], force: bool, remote: bool, catalog: str | None,
       **where) -> None:
    """Forget snapshots: their records go, their data stays until rametfs gc.

    Refused (exit 5, saying why) while a snapshot is an execution's base or head (reset
    returns to it) or a pool's base, and, unless --force, while a name points at it.  A snapshot that is only another's parent is forgotten like any other.  They
    go one at a time, in order: the first refused stops the rest.  docs/lifecycle.md.

    With --remote: delist published snapshots from the catalog, all or none (refused while
    a catalog name points at one, unless --force); their objects stay until gc --remote.
    Workers keep what they fetched of them.
    """
    if remote:
        with remote_catalog(catalog, "rm") as cat:
            ids = list(dict.fromkeys(published_id(cat, ref) for ref in snapshots))
            names = cat.remove_snapshots(ids, force)
        for sid in ids:
            click.echo(f"delisted {sid.hex()}")
        for name in names:
            click.echo(f"deleted published name {name}")
        return
    _rm_local(snapshots=snapshots, force=force, **where)


@ramet_options
def _rm_local(ramet: Ramet, snapshots: tuple[str, ...], force: bool) -> None:
    ids = [ramet.resolve(ref) for ref in snapshots]  # ENOENT before anything goes
    for sid in dict.fromkeys(ids):
        reply = ramet.rm(sid, force=force)
        click.echo(f"removed {sid}" + "".join(f"; deleted name {n}" for n in reply["names"]))


@main.command()
@click.option("--dry-run", is_flag=True, help="Say what would go, and its bytes; delete nothing.")
@click.option("--compact", is_flag=True,
              help="Then rewrite the metadata file without its free pages (offline: --data of "
                   "a data directory no daemon serves).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--grace", type=click.FloatRange(min=0), metavar="SECONDS",
              help="With --remote: a publish not seen for this long is taken for dead (and "
                   "fails when it comes back); default 3600.")
@click.option("--wait", type=click.FloatRange(min=0), metavar="SECONDS",
              help="With --remote: how long to wait for running publishes to end; default "
                   "600.")
@remote_flag
def gc(dry_run: bool, compact: bool, as_json: bool, grace: float | None, wait: float | None,
       remote: bool, catalog: str | None, **where) -> None:
    """Delete every chunk, content and tree that no snapshot, execution or pool reaches.

    What rm forgot, what a failed or killed import left: gone, and the space reused by the
    store (its free pages); --compact also gives it back to the file system.  Runs in the
    daemon while executions, promotes and imports go on (fallback mode: in this process);
    progress on stderr.  docs/lifecycle.md.

    With --remote: the remote's objects no listed snapshot reaches, their catalog rows and
    then the packs left with none; safe while workers publish (it waits for running
    publishes, up to --wait): docs/remote.md.
    """
    if remote:
        if compact:
            raise click.UsageError("--compact is of a local store: not with --remote")
        return _gc_remote(catalog, dry_run, grace, wait, as_json)
    if grace is not None or wait is not None:
        raise click.UsageError("--grace and --wait go with --remote")
    _gc_local(dry_run=dry_run, compact=compact, as_json=as_json, **where)


def _gc_remote(catalog: str | None, dry_run: bool, grace: float | None, wait: float | None,
               as_json: bool) -> None:
    """``rametfs gc --remote``."""
    report = _run_gc_remote(catalog, dry_run, grace, wait)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        _print_gc_remote(report)


def _run_gc_remote(catalog: str | None, dry_run: bool, grace: float | None = None,
                   wait: float | None = None) -> dict:
    """The report of a gc of the remote the catalog belongs to
    (rametfs.store.remote_gc.collect; ``grace``, ``wait``: None for its defaults)."""
    from rametfs import errors
    from rametfs.store.remote import Remote
    from rametfs.store.remote_gc import GRACE_S, WAIT_S, collect
    with remote_catalog(catalog, "gc") as cat:
        cat.snapshots()  # reads the remote the catalog records
        url = cat.recorded_remote
    if url is None:
        raise RametError(errno.ENOENT, "gc --remote: the catalog records no remote: nothing "
                                       "was published to it")
    where = Remote(url, catalog)
    try:
        with _progress_bar() as progress:
            return collect(where, dry_run, GRACE_S if grace is None else grace,
                           WAIT_S if wait is None else wait, progress).to_json()
    except errors.RametError as exc:
        raise RametError(exc.errno, f"gc --remote: {exc}") from None
    finally:
        where.close()


def _print_gc_remote(report: dict) -> None:
    kinds = ("chunk", "content", "tree")
    click.echo(f"{'would delete' if report['dry_run'] else 'deleted'} "
               + ", ".join(f"{report['deleted'][k]} {k}s" for k in kinds)
               + f"; {report['packs']} packs ({human_bytes(report['bytes'])})"
               + ("" if report["dry_run"]
                  else f", and {report['stray_packs']} packs no catalog row named"))
    click.echo("kept " + ", ".join(f"{report['kept'][k]} {k}s" for k in kinds)
               + f" reached from {report['snapshots']} published snapshots")


@ramet_options
def _gc_local(ramet: Ramet, dry_run: bool, compact: bool, as_json: bool) -> None:
    if compact:
        if ramet.mode != "fallback":
            raise click.UsageError("--compact is offline: give --mode fallback --data DIR of a "
                                   "data directory no daemon serves (rametfs umount first)")
        try:
            lock = mounts.take_data_lock(str(ramet.data))  # EBUSY while a daemon serves it
        except RametError as exc:
            raise RametError(exc.errno, f"gc --compact: {exc}") from None
    with _progress_bar() as progress:
        report = ramet.gc(dry_run=dry_run, progress=progress)
    if compact and not dry_run:
        try:
            from rametfs.store.gc import compact as compact_store  # only here: lmdb
            ramet.close()  # the store must be closed to be swapped
            report["compact"] = dict(zip(("before", "after"), compact_store(ramet.data)))
        finally:
            os.close(lock)
    elif compact:
        os.close(lock)
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
        return
    _print_gc(report)


def _print_gc(report: dict) -> None:
    """The lines of a gc report, for people."""
    verb = "would delete" if report["dry_run"] else "deleted"
    click.echo(f"{verb} {report['chunks']} chunks ({human_bytes(report['chunk_bytes'])}), "
               f"{report['contents']} contents ({human_bytes(report['content_bytes'])}), "
               f"{report['trees']} trees ({human_bytes(report['tree_bytes'])}): "
               f"{human_bytes(report['bytes'])} of {report['bytes']} bytes; "
               f"{report['cache_files']} cache files ({human_bytes(report['cache_bytes'])})")
    click.echo(f"kept {report['kept_chunks']} chunks, {report['kept_contents']} contents, "
               f"{report['kept_trees']} trees reached from {report['roots']} roots")
    if "compact" in report:
        c = report["compact"]
        click.echo(f"compacted the metadata file: {human_bytes(c['before'])} -> "
                   f"{human_bytes(c['after'])}")


@main.command()
@click.option("--keep-last", type=int, metavar="N", help="Keep the N newest snapshots.")
@click.option("--keep-within", metavar="DURATION",
              help="Keep the snapshots younger than DURATION before the newest one: whole "
                   "numbers of y, m (months), d, h in that order (7d, 36h, 1y2m).")
@click.option("--keep-name", metavar="PATTERN",
              help="Keep the snapshots a name matching the glob PATTERN points at.")
@click.option("--dry-run", is_flag=True, help="Say what would go and why the rest stays; "
              "change nothing.")
@click.option("--prune", is_flag=True, help="Then run gc, which frees their data.")
@click.option("--json", "as_json", is_flag=True, help="Print the reply as JSON.")
@remote_flag
def forget(keep_last: int | None, keep_within: str | None, keep_name: str | None,
           dry_run: bool, prune: bool, as_json: bool, remote: bool, catalog: str | None,
           **where) -> None:
    """Forget the snapshots no rule keeps (restic's forget); --prune then runs gc.

    A snapshot any rule keeps stays, and so does every execution's base and head and every
    pool's base; the names pointing at a forgotten snapshot are deleted.  One line per
    snapshot, newest first, as restic prints them: id, label, why it is kept.
    docs/lifecycle.md.

    With --remote: the same rules over the published snapshots, which are delisted, with
    the catalog names pointing at them; --prune then runs gc --remote.
    """
    if remote:
        return _forget_remote(catalog, keep_last, keep_within, keep_name, dry_run, prune,
                              as_json)
    _forget_local(keep_last=keep_last, keep_within=keep_within, keep_name=keep_name,
                  dry_run=dry_run, prune=prune, as_json=as_json, **where)


def _forget_remote(catalog: str | None, keep_last: int | None, keep_within: str | None,
                   keep_name: str | None, dry_run: bool, prune: bool, as_json: bool) -> None:
    """``rametfs forget --remote``: retention.plan over the listed snapshots."""
    import msgpack
    from rametfs.core import retention
    with remote_catalog(catalog, "forget") as cat:
        policy = retention.policy_of(protocol.Forget(
            keep_last, None if keep_within is None else protocol.Duration.parse(keep_within),
            keep_name, dry_run))
        records = {sid.hex(): msgpack.unpackb(value) for sid, value in cat.snapshots()}
        names = cat.names()
        decided = retention.plan([(sid, r["created_ns"]) for sid, r in records.items()],
                                 names, {}, policy)
        gone = sorted(n for n, sid in names.items() if sid in set(decided.forget))
        if decided.forget and not dry_run:
            cat.remove_snapshots([bytes.fromhex(sid) for sid in decided.forget], force=True)
    reply = {"ok": True, "dry_run": dry_run,
             "kept": [{"snapshot": sid, "reasons": why} for sid, why in decided.keep.items()],
             "removed": decided.forget, "names": gone}
    if prune and not dry_run:
        reply["gc"] = _run_gc_remote(catalog, False)
    if as_json:
        click.echo(json.dumps(reply, indent=2, sort_keys=True))
        return
    _print_forget(reply, {sid: printable(r["label"] or "") for sid, r in records.items()},
                  dry_run)
    if prune and dry_run:
        click.echo("gc not run in a dry run: nothing was forgotten")
    elif prune:
        _print_gc_remote(reply["gc"])


def _print_forget(reply: dict, labels: dict[str, str], dry_run: bool) -> None:
    """What forget kept and removed, for people."""
    click.echo(f"keep {len(reply['kept'])} snapshots:")
    for k in reply["kept"]:
        click.echo(f"  {k['snapshot'][:12]}  {labels.get(k['snapshot']) or '-'}  "
                   f"{', '.join(k['reasons'])}")
    click.echo(f"{'would remove' if dry_run else 'removed'} {len(reply['removed'])} snapshots:")
    for sid in reply["removed"]:
        click.echo(f"  {sid[:12]}  {labels.get(sid) or '-'}")
    for name in reply["names"]:
        click.echo(f"{'would delete' if dry_run else 'deleted'} name {name}")


@ramet_options
def _forget_local(ramet: Ramet, keep_last: int | None, keep_within: str | None,
                  keep_name: str | None, dry_run: bool, prune: bool, as_json: bool) -> None:
    labels = {s["id"]: printable(s["label"] or "") for s in ramet.snapshots()}
    with _progress_bar() as progress:
        reply = ramet.forget(keep_last, keep_within, keep_name, dry_run=dry_run, prune=prune,
                             progress=progress)
    if as_json:
        click.echo(json.dumps(reply, indent=2, sort_keys=True))
        return
    _print_forget(reply, labels, dry_run)
    if prune and dry_run:
        click.echo("gc not run in a dry run: nothing was forgotten")
    elif prune:
        _print_gc(reply["gc"])


@contextlib.contextmanager
def _progress_bar() -> Iterator:
    """A ``progress(phase, done, total)`` drawing a tqdm bar on stderr when it is a terminal
    (and tqdm is installed), else None."""
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is None or not sys.stderr.isatty():
        yield None
        return
    bar = tqdm(leave=False, file=sys.stderr, unit="", dynamic_ncols=True)

    def progress(phase: str, done: int, total: int) -> None:
        if bar.desc != phase:
            bar.set_description_str(phase)
            bar.reset(total=total or None)
        bar.n = done
        bar.refresh()

    try:
        yield progress
    finally:
        bar.close()


# ----- helpers ---------------------------------------------------------------------------

def ancestry(snapshots: list[dict], sid: str) -> list[dict]:
    """The snapshot of id ``sid`` and every ancestor reachable through ``parents`` that is
    still stored (a forgotten parent ends its line: docs/lifecycle.md), newest first."""
    by_id = {s["id"]: s for s in snapshots}
    seen, todo = set(), [sid]
    while todo:
        i = todo.pop()
        if i in by_id and i not in seen:
            seen.add(i)
            todo += by_id[i]["parents"]
    return sorted((by_id[i] for i in seen), key=lambda s: s["created_ns"], reverse=True)


def access_cell(record: dict) -> str:
    """``owner:group/share/control`` of an execution record (``0:0/0700/full``), or ``-``
    when the record does not show them (another uid reads the root status)."""
    if "owner" not in record:
        return "-"
    return f"{record['owner']}:{record['group']}/{record['share']}/{record['control']}"


def quota_cell(record: dict) -> str:
    """``max-bytes/max-inodes`` of an execution record, ``-`` for no limit (``1.0G/-``)."""
    size, inodes = record.get("max_bytes"), record.get("max_inodes")
    return f"{human_bytes(size) if size else '-'}/{inodes or '-'}"


def lease_cells(lease: dict | None, now_ns: int) -> tuple[str, str]:
    """``(holder with pid and host, time left)`` of a lease record, or ``("-", "-")``;
    a lease past its end shows ``expired`` (the daemon is returning it)."""
    if lease is None:
        return "-", "-"
    left = lease["expires_ns"] - now_ns
    return lease_holder(lease), f"in {human_age(left)}" if left > 0 else "expired"


def lease_holder(lease: dict) -> str:
    """A lease's holder with the pid and host it gave, those it gave only (a lease acquired
    by a control command may give neither): ``me (pid 12 on h)``, ``me (pid 12)``, ``me``."""
    where = " ".join(part for part in (f"pid {lease['pid']}" if lease["pid"] else "",
                                       f"on {lease['host']}" if lease["host"] else "") if part)
    return printable(f"{lease['holder']} ({where})" if where else lease["holder"])


def printable(text: str, lines: bool = False) -> str:
    """``text`` safe to print to a terminal: every character ``str.isprintable`` rejects
    (control and format characters such as ESC or U+202E, separators but the space, lone
    surrogates) and every backslash as its Python escape (``\\x1b``, ``\\n``, ``\\u202e``,
    ``\\\\``), so no label can move the cursor or pass for another.  ``lines`` (messages):
    newlines and tabs are kept, backslashes left as they are."""
    def safe(c: str) -> bool:
        return (c in "\n\t" or c.isprintable()) if lines else (c.isprintable() and c != "\\")

    return "".join(c if safe(c) else c.encode("unicode_escape").decode("ascii") for c in text)


def format_table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns two spaces apart, no trailing spaces."""
    widths = [max(map(len, column)) for column in zip(headers, *rows)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in (headers, *rows))


def human_bytes(n: int) -> str:
    """``512`` -> ``"512B"``, ``1536`` -> ``"1.5K"``, ``10 << 20`` -> ``"10M"`` (powers of 1024)."""
    units, i, value = "BKMGT", 0, float(n)
    while value >= 1024 and i < len(units) - 1:
        value, i = value / 1024, i + 1
    return f"{value:.1f}{units[i]}" if i and value < 10 else f"{value:.0f}{units[i]}"


def human_age(ns: int) -> str:
    """An age in nanoseconds, in its largest whole unit: ``"45s"``, ``"3m"``, ``"2h"``, ``"4d"``."""
    seconds = max(ns, 0) // 1_000_000_000
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


@contextlib.contextmanager
def _elapsed(label: str) -> Iterator[None]:
    """A spinner with the elapsed seconds on stderr while the block runs, if it is a tty."""
    if not sys.stderr.isatty():
        yield
        return
    done = threading.Event()
    start = time.monotonic()

    def spin() -> None:
        for frame in itertools.cycle("|/-\\"):
            click.echo(f"\r{frame} {label} {time.monotonic() - start:.0f}s", err=True, nl=False)
            if done.wait(0.2):
                break
        click.echo("\r\033[K", err=True, nl=False)

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        yield
    finally:
        done.set()
        spinner.join()
