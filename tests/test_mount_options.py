"""Mount options through the real mount: ``nodev,nosuid`` by default, lifted for the executions
by ``--allow-devices`` and ``--allow-suid`` (root only), with ``snapshots/``'s read-only bind
``nodev,nosuid`` either way (docs/security.md, "Device nodes and set-user-ID files")."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import Daemon, check_log, require_fuse
from rametfs import mounts, protocol
from rametfs.cli import main
from rametfs.errors import RametError

NOBODY = 65534


def options(path: Path) -> set[str]:
    """The per-mount options (mountinfo's sixth field) of the mount at ``path``."""
    with open("/proc/self/mountinfo") as f:
        for line in reversed(f.read().splitlines()):  # the top one, mounted last
            fields = line.split()
            if fields[4] == os.fspath(path):
                return set(fields[5].split(","))
    raise AssertionError(f"{path} is not mounted")


def steps(d: Daemon, base: Path) -> dict:
    """A /dev/null node and a set-user-ID root copy of id(1) in a new execution, used as
    uid 65534: what opening the node and running the copy give."""
    src = base / "src"
    src.mkdir()
    shutil.copy2("/usr/bin/id", src / "id")
    os.chmod(src / "id", 0o4755)  # owned by root
    reply = d.ctl(protocol.format_command("create", d.snapshot(src), share="0755"))
    ex = d.exec_path(reply["execution"])
    os.mknod(ex / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    out = {"options": options(d.mnt) & {"nodev", "nosuid"},
           "snapshots": options(d.mnt / "snapshots") & {"nodev", "nosuid", "ro"},
           "mode": stat.filemode(os.stat(ex / "id").st_mode)}
    try:
        with open(ex / "null", "r+b") as f:
            out["null"] = (f.write(b"gone"), f.read())
    except OSError as exc:
        out["null"] = errno.errorcode[exc.errno]
    out["euid"] = subprocess.run([ex / "id", "-u"], user=NOBODY, group=NOBODY, extra_groups=[],
                                 capture_output=True, text=True, check=True).stdout
    return out


@pytest.mark.kernel
@pytest.mark.parametrize("allow", [False, True])
def test_devices_and_set_user_id_files_only_with_the_flags(allow):
    require_fuse()
    base = Path(tempfile.mkdtemp(prefix="rametfs-options-", dir="/tmp"))
    os.chmod(base, 0o755)  # uid 65534 runs the copy of id from the mount
    flags = ("--allow-devices", "--allow-suid") if allow else ()
    d = Daemon(base / "data", base / "mnt", serve_args=("--allow-other", *flags))
    try:
        d.start()
        got = steps(d, base)
        d.stop()
        check_log(d.log_text(), [], repr(d))
    finally:
        if d.pid is not None:
            d.kill()
        if not os.path.ismount(d.mnt):
            shutil.rmtree(base)
    assert got["mode"] == "-rwsr-xr-x"  # stored as it is either way
    assert got["snapshots"] == {"nodev", "nosuid", "ro"}
    if allow:
        assert got["options"] == set()
        assert got["null"] == (4, b"")  # the real /dev/null
        assert got["euid"] == "0\n"
    else:
        assert got["options"] == {"nodev", "nosuid"}
        assert got["null"] == "EACCES"
        assert got["euid"] == f"{NOBODY}\n"


@pytest.mark.parametrize("flags", [["--allow-devices"], ["--allow-suid"],
                                   ["--allow-devices", "--allow-suid", "--background"]])
def test_the_flags_are_refused_to_other_users(tmp_path, monkeypatch, flags):
    """A caller whose euid is not 0 gets EPERM and a message naming the flags, before any
    mount (libfuse would have mounted nodev,nosuid regardless)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    result = CliRunner().invoke(main, ["mount", "--data", str(tmp_path / "data"),
                                       str(tmp_path / "mnt"), *flags])
    asked = " and ".join(f for f in flags if f.startswith("--allow"))
    assert result.exit_code == 1
    assert result.output == (f"rametfs: {asked}: only root may mount with device nodes or "
                             f"set-user-ID bits honoured (euid 1000)\n")
    assert not os.path.ismount(tmp_path / "mnt")
    with pytest.raises(RametError) as exc:
        mounts.check_mount_options(True, False)
    assert exc.value.errno == errno.EPERM


@pytest.mark.kernel
def test_fsname_names_the_mount_in_the_mount_table(tmp_path):
    """``--fsname`` is the source findmnt and df show (fstests finds its TEST_DEV so); the
    type stays fuse.rametfs, which rametfs's own commands look for.  A comma, which would
    split the mount options, is a usage error."""
    require_fuse()
    d = Daemon(tmp_path / "data", tmp_path / "mnt", serve_args=("--fsname", "/srv/src-1"))
    d.start()
    try:
        found = subprocess.run(["findmnt", "-rnv", "-o", "SOURCE,FSTYPE", d.mnt],
                               capture_output=True, text=True, check=True).stdout
    finally:
        d.stop()
    assert found.splitlines()[0] == "/srv/src-1 fuse.rametfs"
    result = CliRunner().invoke(main, ["mount", "--data", str(tmp_path / "data"),
                                       str(tmp_path / "mnt"), "--fsname", "a,b"])
    assert result.exit_code == 2
    assert "'a,b': a name without commas, blanks or backslashes" in result.output
