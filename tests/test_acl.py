"""POSIX ACLs in executions, as ext4 has them (rametfs.core.acl).

The mounted cases run the same shell steps with the real tools (``setfacl``, ``getfacl``,
``getfattr``, ``chmod``, ``touch``, ``mkdir``) in an execution and in a ``cp -a`` copy of its
source on the host's ext4, and both outputs must be equal, besides the exact values written
out; the steps of another uid run as uid 65534 against a daemon serving ``--allow-other``
(tests/test_conformance.py, cases 5 and 6).  The model's cases check what only the daemon sees:
values no kernel would pass on.
"""

from __future__ import annotations

import base64
import errno
import os
import random
import struct
import subprocess
from pathlib import Path

import pytest

from benchmarks.fuse_trace import FuseTrace
from benchmarks.systems import Unsupported
from conftest import RUN_TIMEOUT_S
from rametfs import Ramet
from rametfs.core import acl
from rametfs.errors import RametError
from rametfs.overlay import Overlay
from rametfs.store import import_tree
from test_conformance import (  # noqa: F401  (fixtures)
    NOBODY, _other_users_daemon, as_nobody, executions, ext4_copy, other_users)
from test_snapshots import write_tree

# A default ACL as ext4 wrote it (getfattr -e base64): u::rwx g::r-x g:100:rwx m::rwx o::r-x.
EXT4_DEFAULT = base64.b64decode("AgAAAAEABwD/////BAAFAP////8IAAcAZAAAABAABwD/////IAAFAP////8=")


def sh(script: str, cwd: Path) -> str:
    """Run ``script`` with sh as root at umask 022; its exit code, stdout and stderr as one
    text (paths in it are relative to ``cwd``)."""
    p = subprocess.run(["sh", "-c", script], cwd=cwd, text=True, capture_output=True,
                       timeout=RUN_TIMEOUT_S, umask=0o022, env={"PATH": "/usr/bin:/bin",
                                                                "LC_ALL": "C"})
    return f"rc={p.returncode}\n{p.stdout}{p.stderr}"


def both(script: str, ex: Path, ext4: Path) -> str:
    """``script``'s output in the execution, asserted equal to its output on ext4."""
    got = sh(script, ex)
    assert got == sh(script, ext4)
    return got


# ----- the value: what the kernel writes, what it refuses ----------------------------------------

def test_a_value_ext4_wrote_decodes_and_encodes_to_the_same_bytes():
    got = acl.decode(EXT4_DEFAULT)
    u = acl.UNDEFINED_ID
    assert got == ((acl.USER_OBJ, 7, u), (acl.GROUP_OBJ, 5, u), (acl.GROUP, 7, 100),
                   (acl.MASK, 7, u), (acl.OTHER, 5, u))
    assert acl.encode(got) == EXT4_DEFAULT


def _value(*entries, version: int = 2) -> bytes:
    return struct.pack("<I", version) + b"".join(struct.pack("<HHI", *e) for e in entries)


U = acl.UNDEFINED_ID
BASE = [(acl.USER_OBJ, 6, U), (acl.GROUP_OBJ, 4, U), (acl.OTHER, 4, U)]


@pytest.mark.parametrize("value, code", [
    (b"", errno.EINVAL),
    (b"\x02\x00\x00", errno.EINVAL),  # short header
    (_value(*BASE) + b"\x00", errno.EINVAL),  # not a whole entry
    (_value(*BASE, version=1), errno.EINVAL),
    (_value(), errno.EINVAL),  # no entries
    (_value(BASE[0], BASE[2]), errno.EINVAL),  # no group::
    (_value(BASE[1], BASE[0], BASE[2]), errno.EINVAL),  # out of order
    (_value(BASE[0], BASE[1], (acl.USER, 7, 5), BASE[2]), errno.EINVAL),  # user:5 after group::
    (_value(BASE[0], (acl.USER, 7, 5), *BASE[1:]), errno.EINVAL),  # named, no mask::
    (_value(BASE[0], (acl.USER, 7, U), BASE[1], (acl.MASK, 7, U), BASE[2]), errno.EINVAL),
    (_value(BASE[0], BASE[1], (0x40, 7, U), BASE[2]), errno.EINVAL),  # unknown tag
    (_value((acl.USER_OBJ, 8, U), *BASE[1:]), errno.EINVAL),  # not rwx
    (_value(*BASE, BASE[2]), errno.EINVAL),  # two other::
    (_value(BASE[0], *[(acl.USER, 7, i) for i in range(600)], BASE[1], (acl.MASK, 7, U),
            BASE[2]), errno.E2BIG),  # past a page
])
def test_malformed_values_are_refused_with_the_kernels_errno(value, code):
    with pytest.raises(RametError) as info:
        acl.decode(value)
    assert info.value.errno == code


def test_inheritance_and_chmod_give_what_ext4_gives():
    # ext4, umask 022, in a directory with EXT4_DEFAULT: touch f -> -rw-rw-r--+ with
    # u::rw- g::r-x g:100:rwx m::rw- o::r--; mkdir d -> drwxrwxr-x+ with the default's entries.
    default = acl.decode(EXT4_DEFAULT)
    mode, access = acl.inherit(default, 0o100666)
    assert (oct(mode), access) == ("0o100664", ((acl.USER_OBJ, 6, U), (acl.GROUP_OBJ, 5, U),
                                               (acl.GROUP, 7, 100), (acl.MASK, 6, U),
                                               (acl.OTHER, 4, U)))
    assert acl.inherit(default, 0o40777) == (0o40775, default)
    assert acl.inherit(acl.decode(_value(*BASE)), 0o100777) == (0o100644, None)
    assert acl.chmod(access, 0o100750) == ((acl.USER_OBJ, 7, U), (acl.GROUP_OBJ, 5, U),
                                           (acl.GROUP, 7, 100), (acl.MASK, 5, U),
                                           (acl.OTHER, 0, U))
    assert acl.equivalent_mode(access, 0o102777) == (0o102664, False)
    assert acl.equivalent_mode(acl.decode(_value(*BASE)), 0o100777) == (0o100644, True)


# ----- the model: values no kernel passes on ------------------------------------------------------

@pytest.fixture
def model(store, tmp_path):
    """``(overlay, execution, node of file f, node of directory d)`` over a small source."""
    snap = import_tree(store, write_tree(tmp_path / "src", {"f": b"x\n", "d/g": b"y\n"}))
    overlay = Overlay(store)
    ex = overlay.create_execution(snap, "e")
    f = overlay.lookup(ex.root_ino, b"f")
    d = overlay.lookup(ex.root_ino, b"d")
    return overlay, ex, f, d


def test_the_model_refuses_malformed_acls_and_changes_nothing(model):
    overlay, ex, f, d = model
    for value in (b"junk", _value(BASE[1], BASE[0], BASE[2])):
        with pytest.raises(RametError) as info:
            overlay.setxattr(f, acl.ACCESS, value)
        assert info.value.errno == errno.EINVAL
    with pytest.raises(RametError) as info:
        overlay.setxattr(f, acl.DEFAULT, EXT4_DEFAULT)  # a file has no default ACL
    assert info.value.errno == errno.EACCES
    with pytest.raises(RametError) as info:
        overlay.setxattr(f, b"system.posix_acl_other", EXT4_DEFAULT)
    assert info.value.errno == errno.EOPNOTSUPP
    assert f.upper is None and overlay.xattrs(f) == {}  # not even copied up


def test_hostile_values_give_only_mapped_errors_and_leave_valid_acls(model):
    overlay, ex, f, d = model
    rng = random.Random(22)
    good = bytearray(EXT4_DEFAULT)
    accepted = 0
    for i in range(3000):
        if i % 3 == 0:
            value = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        else:  # a valid value with a few bytes changed, cut or grown
            value = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                value[rng.randrange(len(value))] = rng.randrange(256)
            value = bytes(value[:rng.randrange(len(value) + 1)] if i % 5 == 0 else value)
        for node, name in ((f, acl.ACCESS), (d, acl.DEFAULT), (d, acl.ACCESS)):
            try:
                overlay.setxattr(node, name, value)
            except RametError as exc:
                assert exc.errno in (errno.EINVAL, errno.E2BIG), exc
            else:
                accepted += 1
    assert accepted > 0
    for node in (f, d):
        for value in overlay.xattrs(node).values():
            assert acl.encode(acl.decode(value)) == value
    overlay.create(d.ino, b"new", 0o666, 0, 0)  # inherits whatever default d ended with
    overlay.flush_all()


def test_a_stored_malformed_default_acl_fails_a_create_with_eio(model):
    overlay, ex, f, d = model
    overlay.copy_up(d).xattrs[acl.DEFAULT] = b"\x02\x00\x00\x00junk"  # as no setxattr stores
    with pytest.raises(RametError) as info:
        overlay.create(d.ino, b"new", 0o666, 0, 0)
    assert info.value.errno == errno.EIO
    overlay.copy_up(d).xattrs.pop(acl.DEFAULT)


# ----- through the mount, beside ext4 -------------------------------------------------------------

def test_setfacl_getfacl_and_the_mode_match_ext4(executions, tmp_path):
    src = write_tree(tmp_path / "src", {"f": b"f\n", "g": b"g\n", "h": b"h\n", "d/x": b"x\n"})
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")
    got = both("setfacl -m u:65534:rw,g:100:r f && getfacl -n f && stat -c '%A %a' f", ex, ext4)
    assert got == ("rc=0\n# file: f\n# owner: 0\n# group: 0\nuser::rw-\nuser:65534:rw-\n"
                   "group::r--\ngroup:100:r--\nmask::rw-\nother::r--\n\n-rw-rw-r-- 664\n")
    # chmod sets the mask entry, and a narrower mask shows in getfacl's #effective.
    got = both("chmod 740 f && getfacl -n f && stat -c '%A' f", ex, ext4)
    assert got == ("rc=0\n# file: f\n# owner: 0\n# group: 0\nuser::rwx\n"
                   "user:65534:rw-\t#effective:r--\ngroup::r--\ngroup:100:r--\nmask::r--\n"
                   "other::---\n\n-rwxr-----\n")
    # An ACL the mode says whole is no ACL: setfacl --set of the base entries, setfacl -b.
    got = both("setfacl --set u::rw,g::r,o::- g && getfattr -m - -d g; stat -c %a g; "
               "setfacl -b f && getfattr -m - -d f; stat -c %a f", ex, ext4)
    assert got == "rc=0\n640\n740\n"
    # Removing an ACL that is not there succeeds; a default ACL only on a directory.
    got = both("setfattr -x system.posix_acl_access h; echo $?; "
               "setfattr -x system.posix_acl_default d; echo $?; "
               "setfacl -d -m u:1:r h; echo $?", ex, ext4)
    assert got == "rc=0\n0\n0\n1\nsetfacl: h: Only directories can have default ACLs\n"
    # Malformed values: the kernel refuses them before the daemon sees them, as on ext4.
    got = both("setfattr -n system.posix_acl_access -v 0sAgAAAAEABwD///// h; echo $?; "
               "setfattr -n system.posix_acl_access -v 0sAQAAAA== h; echo $?; getfacl -n h",
               ex, ext4)
    assert got == ("rc=0\n1\n1\n# file: h\n# owner: 0\n# group: 0\nuser::rw-\ngroup::r--\n"
                   "other::r--\n\nsetfattr: h: Invalid argument\n"
                   "setfattr: h: Operation not supported\n")


INHERIT = """
setfacl -d -m g:100:rwx,o::- d && mkdir plain
umask 077
touch d/f plain/f && mkdir d/sub plain/sub && mkdir -m 700 d/m && mkfifo d/p && ln -s f d/l
python3 -c 'import os; os.mknod("d/n", 0o100666)'
stat -c '%n %A' d/f d/sub d/m d/p d/l d/n plain/f plain/sub
getfacl -n d/f d/sub d/m d/p
"""


def test_a_default_acl_is_inherited_without_the_umask_as_on_ext4(executions, tmp_path):
    src = write_tree(tmp_path / "src", {"d/keep": b""})
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")
    got = both(INHERIT, ex, ext4)
    head = "# owner: 0\n# group: 0\n"
    assert got == (
        "rc=0\nd/f -rw-rw----\nd/sub drwxrwx---\nd/m drwx------\nd/p prw-rw----\n"
        "d/l lrwxrwxrwx\nd/n -rw-rw----\nplain/f -rw-------\nplain/sub drwx------\n"
        f"# file: d/f\n{head}user::rw-\ngroup::r-x\t#effective:r--\ngroup:100:rwx\t"
        "#effective:rw-\nmask::rw-\nother::---\n\n"
        f"# file: d/sub\n{head}user::rwx\ngroup::r-x\ngroup:100:rwx\nmask::rwx\nother::---\n"
        "default:user::rwx\ndefault:group::r-x\ndefault:group:100:rwx\ndefault:mask::rwx\n"
        "default:other::---\n\n"
        f"# file: d/m\n{head}user::rwx\ngroup::r-x\t#effective:---\ngroup:100:rwx\t"
        "#effective:---\nmask::---\nother::---\ndefault:user::rwx\ndefault:group::r-x\n"
        "default:group:100:rwx\ndefault:mask::rwx\ndefault:other::---\n\n"
        f"# file: d/p\n{head}user::rw-\ngroup::r-x\t#effective:r--\ngroup:100:rwx\t"
        "#effective:rw-\nmask::rw-\nother::---\n\n")


OTHER_UID_STEPS = [
    "cat acl-r",            # imported ACL u:65534:r on a 0640 root file
    "cat plain",            # 0640 root file, no ACL
    "ls private",           # 0700 root directory with u:65534:rx
    "echo w >> acl-w",      # u:65534:rw on a 0644 root file
    "setfacl -m u:65534:rwx plain",  # not the owner
    "setfacl -m u:0:rwx mine-sgid && stat -c %a mine-sgid",  # owner, not in group 100
    "touch private/x",      # no w in the ACL
    "cat masked",           # u:65534:r, then chmod 600 (mask ---) in the tree
]


def test_another_uid_is_granted_and_refused_by_the_acl_as_on_ext4(other_users, tmp_path):
    new, ext4_base = other_users
    src = write_tree(tmp_path / "src", {"acl-r": b"r\n", "plain": b"p\n", "private/in": b"",
                                        "acl-w": b"", "mine-sgid": b"", "masked": b"m\n"})
    os.chmod(src, 0o755)
    for rel, mode in [("acl-r", 0o640), ("plain", 0o640), ("private", 0o700),
                      ("acl-w", 0o644), ("masked", 0o640)]:
        os.chmod(src / rel, mode)
    os.chown(src / "mine-sgid", NOBODY, 100)
    os.chmod(src / "mine-sgid", 0o2775)
    subprocess.run(["setfacl", "-m", "u:65534:r", src / "acl-r"], check=True)
    subprocess.run(["setfacl", "-m", "u:65534:rx", src / "private"], check=True)
    ex, ext4 = new(src), ext4_copy(src, ext4_base / "tree")
    for root in (ex, ext4):  # made in the execution (or the ext4 copy), not imported
        subprocess.run("setfacl -m u:65534:rw acl-w && setfacl -m u:65534:r masked && "
                       "chmod 600 masked", shell=True, cwd=root, check=True)

    def steps(root: Path) -> list:
        return [[line, p.returncode, p.stdout, p.stderr] for line in OTHER_UID_STEPS
                for p in [as_nobody("sh", "-c", line, cwd=root)]]

    got = steps(ex)
    assert got == steps(ext4)
    assert [(row[1], row[2]) for row in got] == [
        (0, "r\n"), (1, ""), (0, "in\n"), (0, ""), (1, ""), (0, "775\n"), (1, ""), (1, "")]
    assert (ex / "acl-w").read_bytes() == b"w\n"



def test_the_kernel_asks_for_an_acl_again_after_each_refresh_of_the_inode(
        other_users, _other_users_daemon, tmp_path):
    """What enforcing ACLs costs (run with ``-s`` for the latency): the kernel reads an
    inode's access ACL (GETXATTR) at a permission check by a caller other than its owner and
    keeps the answer, an absent ACL too, until it next refreshes the inode's attributes: the
    execution root at every walk by name (entry timeout 0), a file at the stat after a read
    that reached the daemon (``cat``'s fstat: a read marks the atime stale)."""
    new, _ = other_users
    d = _other_users_daemon[0]
    src = write_tree(tmp_path / "src", {f"d/f{i:02}": b"x\n" for i in range(20)})
    os.chmod(src, 0o755)
    done = []
    try:
        with FuseTrace(d.mnt, name="rametfs-acl") as trace:
            for _ in range(3):  # again, on a new execution, if the kernel dropped its caches
                ex = new(src)   # meanwhile (another process's drop_caches, memory pressure)

                def cat(ex=ex):
                    done.append(as_nobody("sh", "-c", "cat d/* > /dev/null", cwd=ex))

                runs = [trace.run(cat) for _ in range(4)]
                if not any(r.counts["READDIRPLUS"] or r.counts["READ"] for r in runs[1:]):
                    break
    except Unsupported as exc:
        pytest.skip(str(exc))
    assert {p.returncode for p in done} == {0}
    # 1: every inode once (the root, d, 20 files), the files read; then each walk revalidates
    # the root (a LOOKUP) and asks for its ACL; 2: d's again after the GETATTR its listing's
    # fstat made, and a GETATTR for each file's fstat after its read, after its open; 3: each
    # file's again; 4: the root's only.
    assert (runs[0].counts["GETXATTR"], runs[0].counts["READ"]) == (22, 20)
    assert [dict(r.counts) for r in runs[1:]] == [
        {"LOOKUP": 1, "GETXATTR": 2, "GETATTR": 21}, {"LOOKUP": 1, "GETXATTR": 21},
        {"LOOKUP": 1, "GETXATTR": 1}]
    print(f"\nGETXATTR median {runs[0].median_us()['GETXATTR_us']:.1f} us")


def getfacl_tree(root: Path) -> str:
    """``getfacl -n`` and the mode of ``root`` and everything below it, sorted by path."""
    return sh("find . | sort | xargs getfacl -n; find . | sort | xargs stat -c '%n %a'", root)


def test_acls_outlive_promote_a_new_execution_and_a_restart(daemon, tmp_path):
    src = write_tree(tmp_path / "src", {"imported": b"i\n", "dir/keep": b""})
    subprocess.run(["setfacl", "-m", "u:65534:rw", src / "imported"], check=True)
    subprocess.run(["setfacl", "-d", "-m", "u:65534:rx", src / "dir"], check=True)
    eid = daemon.create(daemon.snapshot(src))
    ex, ext4 = daemon.exec_path(eid), ext4_copy(src, tmp_path / "ext4")
    want = both("touch dir/made && mkdir dir/sub && touch dir/sub/deep made && "
                "setfacl -m g:100:rwx made && chmod 741 imported", ex, ext4)
    assert want == "rc=0\n"
    want = getfacl_tree(ext4)
    assert getfacl_tree(ex) == want
    assert "# file: imported\n# owner: 0\n# group: 0\nuser::rwx\nuser:65534:rw-\t" \
           "#effective:r--\ngroup::r--\nmask::r--\nother::--x\n" in want
    promoted = daemon.exec_ctl(eid, "promote")["snapshot"]
    again = daemon.create(promoted)
    assert getfacl_tree(daemon.snap_path(promoted)) == want
    assert getfacl_tree(daemon.exec_path(again)) == want
    daemon.restart()
    for root in (ex, daemon.exec_path(again), daemon.snap_path(promoted)):
        assert getfacl_tree(root) == want


def test_fallback_executions_keep_acls_and_drop_what_the_host_inherits_unasked(tmp_path):
    # Fallback mode writes real files (a copy or reflink carries no xattrs, so each entry's
    # are set again), and the host gives a file made in a directory with a default ACL the
    # ACLs it inherits, which d/bare and d/sub do not have in the snapshot.
    src = write_tree(tmp_path / "src", {"f": b"f\n", "d/bare": b"", "d/sub/deep": b""})
    subprocess.run("setfacl -m u:65534:rw f && setfacl -d -m u:65534:rx d && "
                   "touch d/inherited && mkdir d/made && touch d/made/deep", shell=True,
                   cwd=src, check=True)
    want = getfacl_tree(src)
    assert "# file: d/inherited\n# owner: 0\n# group: 0\nuser::rw-\nuser:65534:r-x\t" \
           "#effective:r--\n" in want and "# file: d/bare\n# owner: 0\n# group: 0\n" \
           "user::rw-\ngroup::r--\nother::r--\n" in want
    with Ramet(data=tmp_path / "data", mode="fallback") as r:
        ex = r.create(r.snapshot(src))
        assert getfacl_tree(ex.path) == want
        sh("rm -r d/bare d/sub d/inherited d/made && setfacl -m g:100:r f", ex.path)
        ex.reset()  # every name of d is written again in d, which keeps its default ACL
        assert getfacl_tree(ex.path) == want
