"""POSIX conformance inside executions: the numbered cases from the field (issue 3).

Each ``test_caseN_*`` is the regression test of case N.  Set-up steps run in the source tree
before it is snapshotted, so every case acts on entries that come from the snapshot (and, where
it matters, on entries made inside the execution too).  The right value is the one ext4 gives:
where a result is not obvious, the same steps also run on a ``cp -a`` copy of the source on the
host file system (ext4) and the two results must be equal, besides the exact values written out.

Cases 5 and 6 run as uid 65534 against a daemon started with ``--allow-other`` (which mounts
with ``allow_other`` and ``default_permissions``); its mountpoint and the ext4 copies live in a
0755 directory under /tmp, because pytest's basetemp is 0700 and uid 65534 could not reach it.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import RUN_TIMEOUT_S, Daemon, check_log, require_fuse, run
from test_snapshots import tree_signature, write_tree

NOBODY = 65534
# uid 65534 cannot reach the test venv's interpreter (it lives under /root, mode 0700).
SYSTEM_PYTHON = "/usr/bin/python3"
TWENTY = b"0123456789abcdefghij"


@pytest.fixture
def executions(shared_daemon):
    """``new(source) -> Path``: snapshot ``source`` and create an execution of it; every
    execution made is released after the test."""
    made: list[str] = []

    def new(source: Path) -> Path:
        eid = shared_daemon.create(shared_daemon.snapshot(source))
        made.append(eid)
        return shared_daemon.exec_path(eid)

    yield new
    live = {e["id"] for e in shared_daemon.status()["executions"]}
    for eid in made:
        if eid in live:
            shared_daemon.ctl(f"release {eid}")


def ext4_copy(source: Path, dest: Path) -> Path:
    run("cp", "-a", source, dest)
    return dest


# ----- case 1: rename of a snapshot directory with children ---------------------------------------
# (Cases 1's first test, 7, 11 and 12 are plain system calls: tests/test_posix.py runs them
# against the model and through the mount.)

def test_case1_rename_of_a_directory_whose_children_changed(executions, tmp_path):
    src = write_tree(tmp_path / "src", {
        "proj/src/main.py": b"main\n", "proj/src/pkg/mod.py": b"mod\n",
        "proj/src/gone/x": b"x\n", "proj/src/deleted": b"deleted\n"})
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")

    def steps(root: Path) -> list:
        d = root / "proj" / "src"
        with open(d / "main.py", "ab") as f:  # copied up
            f.write(b"more\n")
        os.unlink(d / "deleted")  # a whiteout
        run("rm", "-rf", d / "gone")
        os.mkdir(d / "gone")  # an opaque directory under the old name
        (d / "gone" / "y").write_bytes(b"y\n")
        (d / "new").write_bytes(b"new\n")
        os.rename(d, root / "proj" / "lib")
        os.mkdir(d)
        out = [os.listdir(d), sorted(run("find", root / "proj", "-printf", "%P %y %s\n"
                                         ).stdout.splitlines())]
        os.rename(root / "proj" / "lib", root / "moved")
        os.rename(root / "moved" / "pkg", d / "pkg")
        out += [sorted(os.listdir(d)), sorted(os.listdir(root / "moved")),
                os.listdir(root / "moved" / "gone"), (root / "moved" / "main.py").read_bytes()]
        return out

    got = steps(ex)
    assert got == steps(ext4)
    assert got[0] == [] and got[2:] == [["pkg"], ["gone", "main.py", "new"], ["y"],
                                        b"main\nmore\n"]
    assert got[1] == [
        " d 4096", "lib d 4096", "lib/gone d 4096", "lib/gone/y f 2", "lib/main.py f 10",
        "lib/new f 4", "lib/pkg d 4096", "lib/pkg/mod.py f 4", "src d 4096"]
    assert tree_signature(ex, times=False) == tree_signature(ext4, times=False)


# ----- case 2: hard links -------------------------------------------------------------------------

def test_case2_hard_links_from_the_snapshot_and_made_inside(executions, tmp_path):
    src = write_tree(tmp_path / "src", {"f": b"a\n", "sub/other": b"other\n"})
    os.link(src / "f", src / "g")
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")

    def steps(root: Path) -> list:
        def links(*names: str) -> list:
            sts = [os.stat(root / n) for n in names]
            return [len({s.st_ino for s in sts}), [s.st_nlink for s in sts]]

        out = [links("f", "g")]
        run("bash", "-c", "echo b >> f", cwd=root)
        out.append((root / "g").read_bytes())
        run("ln", "f", "h", cwd=root)
        out.append(links("f", "g", "h"))
        (root / "n").write_bytes(b"new\n")
        os.link(root / "n", root / "m")
        os.link(root / "n", root / "sub" / "o")
        out.append(links("n", "m", "sub/o"))
        os.unlink(root / "m")
        out.append(links("n", "sub/o"))
        os.link(root / "sub" / "other", root / "other-too")  # a snapshot file, linked late
        out.append(links("sub/other", "other-too"))
        os.unlink(root / "f")
        out.append(links("g", "h"))
        out.append((root / "h").read_bytes())
        return out

    assert steps(ex) == steps(ext4) == [
        [1, [2, 2]], b"a\nb\n", [1, [3, 3, 3]], [1, [3, 3, 3]], [1, [2, 2]], [1, [2, 2]],
        [1, [2, 2]], b"a\nb\n"]
    assert tree_signature(ex, times=False) == tree_signature(ext4, times=False)


# ----- case 3: appends ----------------------------------------------------------------------------

def test_case3_appends_to_a_snapshot_file(executions, tmp_path):
    src = write_tree(tmp_path / "src", {"log": b"one\n", "other": b"0123456789"})
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")

    def steps(root: Path) -> list:
        run("bash", "-c", "echo two >> log", cwd=root)
        run("bash", "-c", "echo two >> log", cwd=root)
        out = [(root / "log").read_bytes()]
        fd = os.open(root / "log", os.O_WRONLY | os.O_APPEND)
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, b"three\n")
            out.append(os.lseek(fd, 0, os.SEEK_CUR))
            os.pwrite(fd, b"four\n", 0)  # Linux: pwrite on O_APPEND appends too
        finally:
            os.close(fd)
        out.append((root / "log").read_bytes())
        out.append(os.stat(root / "log").st_size)
        # The end moves under an O_APPEND descriptor: a truncate, then a write past it.
        fd = os.open(root / "other", os.O_WRONLY | os.O_APPEND)
        try:
            os.truncate(root / "other", 3)
            os.write(fd, b"A")
            with open(root / "other", "r+b") as f:
                f.write(b"wxyz-extended")
            os.write(fd, b"B")
        finally:
            os.close(fd)
        out.append((root / "other").read_bytes())
        return out

    assert steps(ex) == steps(ext4) == [
        b"one\ntwo\ntwo\n", 18, b"one\ntwo\ntwo\nthree\nfour\n", 23, b"wxyz-extendedB"]


# ----- case 4: truncation, also after a restart ---------------------------------------------------

def test_case4_truncation_gives_exact_bytes_also_after_restart(daemon, tmp_path):
    names = ["redirect", "o_trunc", "grow", "shrink", "shrink-grow", "big"]
    big = os.urandom(3 * 65536 + 100)
    src = write_tree(tmp_path / "src", {n: TWENTY for n in names if n != "big"} | {"big": big})
    snap = daemon.snapshot(src)
    ex = daemon.exec_path(daemon.create(snap))

    run("bash", "-c", "printf BB > redirect", cwd=ex)
    fd = os.open(ex / "o_trunc", os.O_WRONLY | os.O_TRUNC)
    try:
        size_after_open = os.fstat(fd).st_size
        os.write(fd, b"xyz")
    finally:
        os.close(fd)
    os.truncate(ex / "grow", 30)
    with open(ex / "shrink", "r+b") as f:
        os.ftruncate(f.fileno(), 7)
    with open(ex / "shrink-grow", "r+b") as f:
        os.ftruncate(f.fileno(), 5)
        os.ftruncate(f.fileno(), 12)  # the cut bytes must not come back
    with open(ex / "big", "r+b") as f:
        os.ftruncate(f.fileno(), 65536 + 10)
        os.ftruncate(f.fileno(), 2 * 65536 + 3)
    expected = {
        "redirect": b"BB", "o_trunc": b"xyz", "grow": TWENTY + bytes(10), "shrink": TWENTY[:7],
        "shrink-grow": TWENTY[:5] + bytes(7), "big": big[:65536 + 10] + bytes(65536 - 7)}

    def contents() -> dict:
        return {n: ((ex / n).read_bytes(), os.stat(ex / n).st_size) for n in names}

    assert size_after_open == 0
    assert contents() == {n: (data, len(data)) for n, data in expected.items()}
    daemon.restart()
    assert contents() == {n: (data, len(data)) for n, data in expected.items()}
    assert (daemon.snap_path(snap) / "redirect").read_bytes() == TWENTY


# ----- cases 5 and 6: callers other than root -----------------------------------------------------

@pytest.fixture(scope="module")
def _other_users_daemon():
    """``(daemon, base, state)``: a daemon serving ``--allow-other`` in a 0755 dir under /tmp;
    ``state["checked"]``: length of its log already checked."""
    require_fuse()
    base = Path(tempfile.mkdtemp(prefix="rametfs-conformance-", dir="/tmp"))
    os.chmod(base, 0o755)
    d = Daemon(base / "data", base / "mnt", serve_args=("--allow-other",))
    state = {"checked": 0}
    try:
        d.start()
        yield d, base, state
        d.stop()
        check_log(d.log_text()[state["checked"]:], [], f"{d!r} at shutdown")
    finally:
        if d.pid is not None:
            d.kill()
        if not os.path.ismount(d.mnt):
            shutil.rmtree(base)


@pytest.fixture
def other_users(_other_users_daemon, request):
    """``(new(source) -> execution path, ext4 dir reachable by uid 65534)``; releases the
    executions made and checks the log lines the daemon wrote during the test."""
    d, base, state = _other_users_daemon
    state["checked"] = len(d.log_text())
    ext4 = Path(tempfile.mkdtemp(prefix="ext4-", dir=base))
    os.chmod(ext4, 0o755)
    made: list[str] = []

    def new(source: Path) -> Path:
        eid = d.create(d.snapshot(source))
        made.append(eid)
        return d.exec_path(eid)

    yield new, ext4
    for eid in made:
        d.ctl(f"release {eid}")
    shutil.rmtree(ext4)
    text = d.log_text()
    new_lines, state["checked"] = text[state["checked"]:], len(text)
    check_log(new_lines, [r for m in request.node.iter_markers("allow_log") for r in m.args],
              repr(d))


def as_nobody(*argv, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``argv`` as uid/gid 65534 with no supplementary groups, no stdin, umask 022."""
    return subprocess.run([os.fspath(a) for a in argv], cwd=cwd, user=NOBODY, group=NOBODY,
                          extra_groups=[], umask=0o022, stdin=subprocess.DEVNULL, text=True,
                          capture_output=True, timeout=RUN_TIMEOUT_S,
                          env={"PATH": "/usr/bin:/bin", "LC_ALL": "C", "HOME": "/nonexistent"})


def nobody_python(code: str, *args, cwd: Path):
    """Run ``code`` with the system Python as uid 65534; returns the JSON it prints."""
    proc = as_nobody(SYSTEM_PYTHON, "-c", code, *args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


CREATE_UNWRITABLE = r"""
import errno, json, os, sys

def attempt(fn, *args):
    try:
        value = fn(*args)
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return value.decode() if isinstance(value, bytes) else value

def opens(path, flags):
    os.close(os.open(path, flags, 0o644))
    return "ok"

out = []
for mode in (0o444, 0o000):
    name = f"made-{mode:03o}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
    try:
        steps = [attempt(os.write, fd, b"hello world"), attempt(os.fsync, fd),
                 attempt(os.ftruncate, fd, 5), attempt(os.pwrite, fd, b"!", 5),
                 attempt(os.pread, fd, 100, 0)]
        st = os.fstat(fd)
        steps.append([oct(st.st_mode), st.st_size, st.st_uid, st.st_gid])
    finally:
        os.close(fd)
    steps.append(attempt(os.rename, name, name + ".renamed"))
    st = os.stat(name + ".renamed")
    steps.append([oct(st.st_mode), st.st_size, st.st_uid, st.st_gid])
    steps.append(attempt(opens, name + ".renamed", os.O_WRONLY))
    steps.append(attempt(opens, name, os.O_RDWR | os.O_CREAT | os.O_EXCL))
    out.append(steps)
print(json.dumps(out))
"""


def test_case5_other_user_creates_unwritable_files_and_uses_the_fd(other_users, tmp_path):
    new, ext4_base = other_users
    src = write_tree(tmp_path / "src", {"owned/keep": b"k\n"})
    os.chmod(src, 0o755)
    os.chown(src / "owned", NOBODY, NOBODY)
    ex, ext4 = new(src), ext4_copy(src, ext4_base / "tree")

    def steps(root: Path) -> list:
        made = as_nobody("mkdir", "made-here", cwd=root / "owned")
        assert made.returncode == 0, made.stderr
        return [nobody_python(CREATE_UNWRITABLE, cwd=root / "owned"),
                nobody_python(CREATE_UNWRITABLE, cwd=root / "owned" / "made-here")]

    got_ex, got_ext4 = steps(ex), steps(ext4)
    assert got_ex == got_ext4
    # write, fsync, ftruncate, pwrite, pread, fstat, rename, stat, reopen for writing,
    # O_EXCL again
    assert got_ex == [[
        [11, None, None, 1, "hello!", ["0o100444", 6, NOBODY, NOBODY], None,
         ["0o100444", 6, NOBODY, NOBODY], "EACCES", "ok"],
        [11, None, None, 1, "hello!", ["0o100000", 6, NOBODY, NOBODY], None,
         ["0o100000", 6, NOBODY, NOBODY], "EACCES", "ok"]]] * 2
    assert tree_signature(ex / "owned", times=False) == tree_signature(ext4 / "owned",
                                                                       times=False)


NOBODY_STEPS = [
    "chmod u+w ro-chmod",
    "chmod u+w none-chmod",
    "rm ro-rm",
    "rm none-rm",
    "mv ro-mv ro-moved",
    "mv none-mv sub/none-moved",
    "sed -i s/x/y/ ro-sed",
    "sed -i s/x/y/ none-sed",  # no read permission: refused on ext4 too
    "chmod u+rw none-sed && sed -i s/x/y/ none-sed",
    "echo more >> ro-write",
    "cat ro-write",
    "cat none-read",
    "mkdir -m 0555 d555",
    "touch d555/inside",
    "mkdir -m 0555 d555/inside",
    "cat ../root-only",
    "touch ../not-mine",
    "rm ../root-file",
    "chmod 0777 ../root-file",
]

OPEN_ATTEMPTS = r"""
import errno, json, os

def attempt(path, flags):
    try:
        os.close(os.open(path, flags, 0o644))
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return "ok"

print(json.dumps([attempt("ro-write", os.O_WRONLY), attempt("ro-write", os.O_RDWR),
                  attempt("ro-write", os.O_WRONLY | os.O_TRUNC), attempt("ro-write", os.O_RDONLY),
                  attempt("none-read", os.O_RDONLY), attempt("none-read", os.O_WRONLY),
                  attempt("../root-only", os.O_RDONLY),
                  attempt("d555/new", os.O_WRONLY | os.O_CREAT)]))
"""


def test_case6_other_user_on_unwritable_snapshot_files(other_users, tmp_path):
    new, ext4_base = other_users
    files = {f"owned/{pre}-{op}": b"x\n" for pre in ("ro", "none")
             for op in ("chmod", "rm", "mv", "sed")}
    src = write_tree(tmp_path / "src", files | {
        "owned/ro-write": b"x\n", "owned/none-read": b"x\n", "owned/sub/keep": b"",
        "root-only": b"secret\n", "root-file": b"root\n"})
    os.chmod(src, 0o755)
    for path in [src / "owned", src / "owned" / "sub"] + list((src / "owned").iterdir()):
        os.chown(path, NOBODY, NOBODY)
    for path in (src / "owned").glob("ro-*"):
        os.chmod(path, 0o444)
    for path in (src / "owned").glob("none-*"):
        os.chmod(path, 0o000)
    os.chmod(src / "root-only", 0o600)
    ex, ext4 = new(src), ext4_copy(src, ext4_base / "tree")

    def steps(root: Path) -> list:
        out = []
        for line in NOBODY_STEPS:
            proc = as_nobody("sh", "-c", line, cwd=root / "owned")
            out.append([line, proc.returncode, proc.stdout, proc.stderr])
        out.append(nobody_python(OPEN_ATTEMPTS, cwd=root / "owned"))
        return out

    got_ex, got_ext4 = steps(ex), steps(ext4)
    assert got_ex == got_ext4
    assert [(row[0], row[1]) for row in got_ex[:-1]] == list(zip(NOBODY_STEPS, [
        0, 0, 0, 0, 0, 0, 0, 2, 0, 2, 0, 1, 0, 1, 1, 1, 1, 1, 1]))
    assert got_ex[-1] == ["EACCES", "EACCES", "EACCES", "ok", "EACCES", "EACCES", "EACCES",
                          "EACCES"]
    mode = {rel: line.split()[1] for rel, line in tree_signature(ex / "owned").items()}
    assert mode == {".": "0755", "ro-chmod": "0644", "none-chmod": "0200", "ro-moved": "0444",
                    "sub": "0755", "sub/keep": "0644", "sub/none-moved": "0000",
                    "ro-sed": "0444", "none-sed": "0600", "ro-write": "0444",
                    "none-read": "0000", "d555": "0555"}
    assert (ex / "owned" / "ro-sed").read_bytes() == (ex / "owned" / "none-sed").read_bytes() \
        == b"y\n"
    assert (ex / "owned" / "ro-write").read_bytes() == b"x\n"
    assert tree_signature(ex, times=False) == tree_signature(ext4, times=False)


PERMISSION_STEPS = [
    "touch sg/f && mkdir sg/d && mkdir sg/d/inner && ln -s f sg/l && mkfifo sg/p",
    "echo y >> w/suid",  # a write by another user clears set-user-ID
    "echo y >> w/sgid",  # and set-group-ID with group execute
    "echo y >> w/sgid-nox",  # without it too, the writer not being in the file's group
    "truncate -s 1 w/suid-trunc",  # a truncate by another user clears both
    "rm sticky/rootfile",
    "rm sticky/mine",
    "touch -d @100 w/rootfile",  # explicit times: owner only
    "touch w/rootfile",  # the current time: write permission is enough
    "chmod 0600 w/rootfile",
    "chown 65534 w/rootfile",
    "chown 0 w/mine",
    "chgrp 100 w/mine",
    "chmod 2755 w/mine100",  # not in group 100: set-group-ID is dropped
    "ln w/rootfile w/hl",
    "ln w/suid-kept w/hl2",  # fs.protected_hardlinks: not the owner
]


def test_other_user_permission_checks_match_ext4(other_users, tmp_path):
    new, ext4_base = other_users
    src = write_tree(tmp_path / "src", {
        "sg/keep": b"", "w/suid": b"x\n", "w/sgid": b"x\n", "w/suid-kept": b"x\n",
        "w/sgid-nox": b"x\n", "w/suid-trunc": b"x\n",
        "w/rootfile": b"x\n", "w/mine": b"x\n", "w/mine100": b"x\n",
        "sticky/rootfile": b"x\n", "sticky/mine": b"x\n"})
    os.chmod(src, 0o755)
    os.chown(src / "sg", 0, 100)
    for rel, mode in [("sg", 0o2777), ("w", 0o777), ("sticky", 0o1777), ("w/suid", 0o4777),
                      ("w/sgid", 0o2777), ("w/suid-kept", 0o4755), ("w/rootfile", 0o666),
                      ("w/sgid-nox", 0o2766), ("w/suid-trunc", 0o6777),
                      ("sticky/rootfile", 0o666)]:
        os.chmod(src / rel, mode)
    os.chown(src / "w" / "sgid", 0, 100)
    for rel in ("w/mine", "sticky/mine"):
        os.chown(src / rel, NOBODY, NOBODY)
    os.chown(src / "w" / "mine100", NOBODY, 100)
    ex, ext4 = new(src), ext4_copy(src, ext4_base / "tree")

    def steps(root: Path) -> list:
        return [[line, proc.returncode, proc.stderr] for line in PERMISSION_STEPS
                for proc in [as_nobody("sh", "-c", line, cwd=root)]]

    got = steps(ex)
    assert got == steps(ext4)
    assert [row[1] for row in got] == [0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 1]
    sig = tree_signature(ex, times=False)
    assert {rel: " ".join(sig[rel].split()[:3]) for rel in [
        "sg/f", "sg/d", "sg/d/inner", "sg/l", "w/suid", "w/sgid", "w/sgid-nox", "w/suid-trunc",
        "w/mine100", "w/hl"]} == {
        "sg/f": "file 0644 65534:100", "sg/d": "dir 2755 65534:100",
        "sg/d/inner": "dir 2755 65534:100", "sg/l": "link 0777 65534:100",
        "w/suid": "file 0777 0:0", "w/sgid": "file 0777 0:100",
        "w/sgid-nox": "file 0766 0:0", "w/suid-trunc": "file 0777 0:0",
        "w/mine100": "file 0755 65534:100", "w/hl": "file 0666 0:0"}
    assert sorted(os.listdir(ex / "sticky")) == ["rootfile"]
    assert sig == tree_signature(ext4, times=False)


# Each: a file's mode before, and what changes it.  Root keeps the set-ID bits on a write or a
# truncate (CAP_FSETID), root without CAP_FSETID does not; a chown of a file clears them for
# anyone, set-group-ID only with group execute, a directory's never.
SET_ID_STEPS = [
    ("write", 0o6777, "echo y >> f"),
    ("truncate", 0o6777, "truncate -s 0 f"),
    ("o-trunc", 0o6777, "echo y > f"),
    ("write-no-fsetid", 0o6777, "setpriv --bounding-set=-fsetid sh -c 'echo y >> f'"),
    ("truncate-no-fsetid", 0o6777, "setpriv --bounding-set=-fsetid truncate -s 0 f"),
    ("o-trunc-no-fsetid", 0o6775, "setpriv --bounding-set=-fsetid sh -c 'echo y > f'"),
    ("write-no-fsetid-sgid-nox", 0o2766, "setpriv --bounding-set=-fsetid sh -c 'echo y >> f'"),
    ("chown", 0o6755, "chown 0:0 f"),
    ("chown-sgid-nox", 0o2745, "chown 0:0 f"),
    ("chown-minus-one", 0o6755, "python3 -c 'import os; os.chown(\"f\", -1, -1)'"),
    ("chown-dir", 0o2755, "mkdir -p d && chmod 2755 d && chown 0:0 d && stat -c %a d > f"),
]


def test_set_id_bits_on_write_truncate_and_chown_match_ext4(executions, tmp_path):
    src = write_tree(tmp_path / "src", {f"{name}/f": b"x\n" for name, _, _ in SET_ID_STEPS})
    for name, mode, _ in SET_ID_STEPS:
        os.chmod(src / name / "f", mode)
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")

    def steps(root: Path) -> dict:
        for name, _, line in SET_ID_STEPS:
            run("sh", "-c", line, cwd=root / name)
        return {name: oct(stat.S_IMODE((root / name / "f").stat().st_mode))
                for name, _, _ in SET_ID_STEPS}

    got = steps(ex)
    assert got == steps(ext4)
    assert got == {"write": "0o6777", "truncate": "0o6777", "o-trunc": "0o6777",
                   "write-no-fsetid": "0o777", "truncate-no-fsetid": "0o777",
                   "o-trunc-no-fsetid": "0o775", "write-no-fsetid-sgid-nox": "0o2766",
                   "chown": "0o755", "chown-sgid-nox": "0o2745", "chown-minus-one": "0o755",
                   "chown-dir": "0o2755"}
    assert (ex / "chown-dir" / "f").read_text() == "2755\n"


# ----- case 8: large directories ------------------------------------------------------------------

def test_case8_unlink_every_entry_while_iterating_then_rmdir(executions, tmp_path):
    from_snapshot = [f"s{n:04d}" for n in range(4000)]
    src = write_tree(tmp_path / "src", {f"big/{n}": n.encode() for n in from_snapshot})
    ex = executions(src)
    made_here = [f"n{n:04d}" for n in range(1000)]
    for name in made_here:
        (ex / "big" / name).write_bytes(b"")

    everything = sorted(from_snapshot + made_here)
    assert sorted(os.listdir(ex / "big")) == everything
    seen = []
    with os.scandir(ex / "big") as entries:
        for entry in entries:
            seen.append(entry.name)
            os.unlink(entry.path)
    assert sorted(seen) == everything  # each entry exactly once
    assert os.listdir(ex / "big") == []
    os.rmdir(ex / "big")
    assert os.listdir(ex) == []


def test_case8_rm_rf_of_a_snapshot_directory_of_3000_files(executions, tmp_path):
    files = {f"bulk/f{n:04d}": b"x" for n in range(2500)}
    files |= {f"bulk/sub{d}/g{n:03d}": b"y" for d in range(5) for n in range(100)}
    src = write_tree(tmp_path / "src", files | {"keep": b"keep\n"})
    ex = executions(src)

    run("rm", "-rf", ex / "bulk")
    assert os.listdir(ex) == ["keep"]
    assert not os.path.lexists(ex / "bulk")
    os.mkdir(ex / "bulk")
    assert os.listdir(ex / "bulk") == []


# ----- case 9: symlinks ---------------------------------------------------------------------------

def test_case9_symlinks(executions, tmp_path):
    src = write_tree(tmp_path / "src", {"target/t1": b"1", "target/t2": b"2",
                                        "tree/file": b"f", "links/plain": b"p", "other/o": b""})
    os.symlink("../target", src / "tree" / "to-target")
    os.symlink("../target", src / "links" / "cur")
    os.symlink("../target/t1", src / "links" / "old")
    os.utime(src / "target" / "t1", ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")
    link_ns = 1_500_000_000_123_456_789

    def steps(root: Path) -> list:
        out = [stat.S_ISLNK(os.lstat(root / "tree" / "to-target").st_mode),
               stat.S_ISDIR(os.stat(root / "tree" / "to-target").st_mode),
               os.path.islink(root / "links" / "cur")]
        run("rm", "-rf", root / "tree")
        out += [os.path.lexists(root / "tree"), sorted(os.listdir(root / "target"))]
        run("ln", "-s", "../target/t2", "new", cwd=root / "links")
        run("ln", "-sfn", "../other", "cur", cwd=root / "links")  # replaces the link itself
        run("ln", "-sf", "../target/t2", "plain", cwd=root / "links")  # over a regular file
        out += [os.readlink(root / "links" / n) for n in ("new", "cur", "plain")]
        out += [sorted(os.listdir(root / "target")), sorted(os.listdir(root / "links" / "cur"))]
        run("touch", "-h", "-d", "@1500000000.123456789", root / "links" / "old")
        link, target = os.lstat(root / "links" / "old"), os.stat(root / "links" / "old")
        out += [link.st_mtime_ns, link.st_atime_ns, target.st_mtime_ns]
        out.append(stat.S_IMODE(os.lstat(root / "links" / "new").st_mode))
        return out

    assert steps(ex) == steps(ext4) == [
        True, True, True, False, ["t1", "t2"], "../target/t2", "../other", "../target/t2",
        ["t1", "t2"], ["o"], link_ns, link_ns, 1_000_000_000_000_000_000, 0o777]
    assert tree_signature(ex, times=False) == tree_signature(ext4, times=False)


# ----- case 10: sqlite in WAL mode ----------------------------------------------------------------

SQLITE_WRITER = r"""
import sqlite3, sys
db = sqlite3.connect(sys.argv[1], timeout=120, isolation_level=None)
assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
assert db.execute("SELECT count(*) FROM t").fetchone() >= (100,)  # the -shm is mapped now
print("ready", flush=True)
sys.stdin.readline()  # both writers start together
for batch in range(200):
    db.execute("BEGIN IMMEDIATE")
    db.executemany("INSERT INTO t (who, n) VALUES (?, ?)",
                   [(sys.argv[2], batch * 25 + i) for i in range(25)])
    db.execute("COMMIT")
db.close()
"""


def test_case10_sqlite_wal_with_two_writers(executions, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    db = sqlite3.connect(src / "app.db")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, who TEXT, n INTEGER)")
    with db:
        db.executemany("INSERT INTO t (who, n) VALUES ('seed', ?)", [(n,) for n in range(100)])
    db.close()
    assert sorted(os.listdir(src)) == ["app.db"]  # the WAL was checkpointed away at close
    ex = executions(src)

    writers = [subprocess.Popen([sys.executable, "-c", SQLITE_WRITER, ex / "app.db", who],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    assert [w.stdout.readline() for w in writers] == ["ready\n", "ready\n"]
    for w in writers:
        w.stdin.write("go\n")
        w.stdin.flush()
    results = [w.communicate(timeout=RUN_TIMEOUT_S) for w in writers]
    assert [(w.returncode, err) for w, (_, err) in zip(writers, results)] == [(0, ""), (0, "")]

    db = sqlite3.connect(ex / "app.db")
    try:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("SELECT who, count(*), sum(n) FROM t GROUP BY who ORDER BY who"
                          ).fetchall() == [("a", 5000, 12_497_500), ("b", 5000, 12_497_500),
                                           ("seed", 100, 4950)]
        assert db.execute("SELECT count(DISTINCT id), max(id) FROM t").fetchone() == (
            10_100, 10_100)
    finally:
        db.close()
    assert sorted(os.listdir(ex)) == ["app.db"]


# ----- case 13: durability across a restart -------------------------------------------------------

@pytest.mark.parametrize("how", ["restart", "kill"])
def test_case13_deletion_and_fsynced_file_survive(daemon, tmp_path, how):
    src = write_tree(tmp_path / "src", {"gone.txt": b"delete me\n", "keep.txt": b"keep\n",
                                        "d/also-gone": b"x", "sub/deep/s": b"s"})
    eid = daemon.create(daemon.snapshot(src))
    ex = daemon.exec_path(eid)
    payload = os.urandom(200_000)

    os.unlink(ex / "gone.txt")
    os.unlink(ex / "d" / "also-gone")
    fd = os.open(ex / "d" / "new.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        os.write(fd, payload)
        os.fsync(fd)
    finally:
        os.close(fd)
    # More kinds of change, made durable by the directory fsyncs below.
    os.rename(ex / "sub", ex / "d" / "sub-moved")
    os.mkdir(ex / "sub")
    os.link(ex / "keep.txt", ex / "d" / "keep-link")
    os.symlink("d/new.bin", ex / "new-link")
    (ex / os.fsdecode(b"raw-\xff")).write_bytes(b"raw")
    os.setxattr(ex / "d", "user.k", b"v")
    os.chmod(ex / "keep.txt", 0o600)
    for directory in (ex, ex / "d"):
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    before = tree_signature(ex)
    if how == "restart":
        daemon.restart()
    else:
        daemon.kill()
        daemon.start()

    assert [e["id"] for e in daemon.status()["executions"]] == [eid]
    assert os.listdir(daemon.mnt / "executions") == [eid]
    assert sorted(os.listdir(ex)) == ["d", "keep.txt", "new-link", os.fsdecode(b"raw-\xff"),
                                      "sub"]
    assert sorted(os.listdir(ex / "d")) == ["keep-link", "new.bin", "sub-moved"]
    assert (ex / "d" / "sub-moved" / "deep" / "s").read_bytes() == b"s"
    assert os.listdir(ex / "sub") == []
    assert (ex / "d" / "new.bin").read_bytes() == payload
    assert stat.S_IMODE(os.stat(ex / "d" / "new.bin").st_mode) == 0o640
    assert tree_signature(ex) == before


# ----- what FUSE (through pyfuse3 3.5) cannot do: pinned so docs/conformance.md stays true ------

def test_limits_under_fuse_are_the_documented_ones(executions, tmp_path):
    ex = executions(write_tree(tmp_path / "src", {"keep": b""}))

    # The kernel marks FUSE inodes S_NOATIME and serves cached reads itself: reads never
    # move atime (explicit utimensat does, see case 9).
    (ex / "read-me").write_bytes(b"data\n")
    os.utime(ex / "read-me", ns=(1_000_000_000_000_000_000, 1_500_000_000_000_000_000))
    assert (ex / "read-me").read_bytes() == b"data\n"
    assert os.stat(ex / "read-me").st_atime_ns == 1_000_000_000_000_000_000
