"""Real developer workloads inside executions: git, a virtualenv and pip, compileall, gcc and
make, tar and ``cp -a`` round trips, ``rm -rf`` of a large tree.

Each workload runs on a tree that comes from a snapshot.  Where a program's output is
deterministic (git commit ids with fixed dates, .pyc and ELF bytes), the same steps run on a
``cp -a`` copy of the source on the host file system (ext4) and the results must be equal; the
exact values are written out besides.  Everything is offline: the wheel that pip installs is
built here, byte by byte.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import run
from test_conformance import executions, ext4_copy  # noqa: F401 (executions is a fixture)
from test_snapshots import tree_signature, write_tree

SUBJECTS = ["initial", "second"]


def git_in(repo: Path, env: dict[str, str]):
    """``git(*args) -> stdout``: git run in ``repo`` with ``env``; raises RunError on failure."""
    return lambda *args: run("git", *args, cwd=repo, env=env).stdout


# ----- git ----------------------------------------------------------------------------------------

@pytest.fixture
def git_env(tmp_path) -> dict[str, str]:
    """An environment for deterministic git: fixed identity and dates, no system config."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[init]\n\tdefaultBranch = main\n[gc]\n\tauto = 0\n"
                                     "[advice]\n\tdetachedHead = false\n")
    stamp = "2024-01-02T03:04:05+00:00"
    return {"PATH": os.environ["PATH"], "HOME": str(home), "LC_ALL": "C",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "Ramet",
            "GIT_AUTHOR_EMAIL": "ramet@example.com", "GIT_COMMITTER_NAME": "Ramet",
            "GIT_COMMITTER_EMAIL": "ramet@example.com", "GIT_AUTHOR_DATE": stamp,
            "GIT_COMMITTER_DATE": stamp}


@pytest.fixture
def repo_source(tmp_path, git_env) -> Path:
    """A source tree holding ``repo``, a git repository with two commits and loose objects."""
    src = write_tree(tmp_path / "src", {
        "repo/README": b"readme\n", "repo/src/app.py": b"print('app')\n",
        "repo/src/util.py": b"def f():\n    return 1\n", "repo/data.bin": os.urandom(70_000)})
    repo = src / "repo"
    git = git_in(repo, git_env)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", SUBJECTS[0])
    (repo / "src" / "util.py").write_bytes(b"def f():\n    return 2\n")
    git("commit", "-q", "-am", SUBJECTS[1])
    return src


def test_git_init_add_commit(executions, repo_source, tmp_path, git_env):
    ex, ext4 = executions(repo_source), ext4_copy(repo_source, tmp_path / "ext4")

    def steps(root: Path) -> list[str]:
        work = root / "work"
        run("cp", "-r", root / "repo" / "src", work)
        git = git_in(work, git_env)
        git("init", "-q")
        git("add", "-A")
        git("commit", "-q", "-m", "first")
        (work / "new.txt").write_bytes(b"new\n")
        git("add", "new.txt")
        git("commit", "-q", "-m", "add new")
        return [git("rev-parse", "HEAD"), git("log", "--format=%s"), git("ls-files"),
                git("status", "--porcelain"), git("fsck", "--strict")]

    got = steps(ex)
    assert got == steps(ext4)
    assert got[1:] == ["add new\nfirst\n", "app.py\nnew.txt\nutil.py\n", "", ""]


def test_git_branch_switch_merge_rebase_stash_gc(executions, repo_source, tmp_path, git_env):
    ex, ext4 = executions(repo_source), ext4_copy(repo_source, tmp_path / "ext4")

    def steps(root: Path) -> list[str]:
        repo = root / "repo"
        git = git_in(repo, git_env)
        out = [git("status", "--porcelain")]  # new inode numbers: git refreshes its index
        git("branch", "feature")
        git("switch", "-q", "feature")
        (repo / "src" / "app.py").write_bytes(b"print('feature')\n")
        git("commit", "-q", "-am", "feature work")
        git("switch", "-q", "main")
        (repo / "notes.txt").write_bytes(b"notes\n")
        git("add", "notes.txt")
        git("commit", "-q", "-m", "main work")
        git("merge", "-q", "--no-edit", "feature")
        out.append((repo / "src" / "app.py").read_bytes().decode())
        git("switch", "-q", "-c", "topic", "main~1")
        (repo / "topic.txt").write_bytes(b"topic\n")
        git("add", "topic.txt")
        git("commit", "-q", "-m", "topic work")
        git("rebase", "-q", "main")
        out.append(git("log", "--format=%s", "--first-parent"))
        out.append(git("rev-parse", "--short", "HEAD").strip())
        (repo / "README").write_bytes(b"changed readme\n")
        git("stash", "-q")
        out += [git("status", "--porcelain"), (repo / "README").read_text(),
                git("stash", "list")]
        git("stash", "pop", "-q")
        out += [git("status", "--porcelain"), (repo / "README").read_text()]
        git("commit", "-q", "-am", "after stash")
        git("gc", "-q", "--aggressive", "--prune=now")
        counts = dict(line.split(": ") for line in git("count-objects", "-v").splitlines())
        out.append((counts["count"], counts["packs"]))
        out += [git("fsck", "--strict"), git("rev-parse", "HEAD", "main", "feature", "topic"),
                git("status", "--porcelain")]
        return out

    got = steps(ex)
    assert got == steps(ext4)
    short = got[3]
    assert got[:10] == [
        "", "print('feature')\n",
        "topic work\nMerge branch 'feature'\nmain work\nsecond\ninitial\n", short,
        "", "readme\n", f"stash@{{0}}: WIP on topic: {short} topic work\n",
        " M README\n", "changed readme\n", ("0", "1")]
    assert got[10] == got[12] == ""
    head, main, feature, topic = got[11].split()
    assert head == topic and len({head, main, feature}) == 3


def test_git_clone_local_of_a_repository_in_the_snapshot(executions, repo_source, tmp_path,
                                                         git_env):
    ex, ext4 = executions(repo_source), ext4_copy(repo_source, tmp_path / "ext4")
    head = git_in(repo_source / "repo", git_env)("rev-parse", "HEAD")
    loose = sorted(p.relative_to(repo_source / "repo" / ".git")
                   for p in (repo_source / "repo" / ".git" / "objects").glob("??/*"))

    def steps(root: Path) -> list:
        run("git", "clone", "-q", "--local", "repo", "clone", cwd=root, env=git_env)
        clone = root / "clone"
        git = git_in(clone, git_env)
        # --local hard-links the object files: same inode, two links each.
        shared = [(os.stat(root / "repo" / ".git" / rel).st_ino
                   == os.stat(clone / ".git" / rel).st_ino,
                   os.stat(clone / ".git" / rel).st_nlink) for rel in loose]
        (clone / "clone.txt").write_bytes(b"in the clone\n")
        git("add", "clone.txt")
        git("commit", "-q", "-m", "in clone")
        return [shared, git("rev-parse", "HEAD~1"), git("log", "--format=%s"),
                git("fsck", "--strict"), git("status", "--porcelain"),
                git_in(root / "repo", git_env)("fsck", "--strict"),
                git_in(root / "repo", git_env)("rev-parse", "HEAD")]

    got = steps(ex)
    assert got == steps(ext4)
    assert len(loose) == 11
    assert got == [[(True, 2)] * len(loose), head, "in clone\nsecond\ninitial\n", "", "", "",
                   head]


# ----- Python: virtualenv, pip, compileall --------------------------------------------------------

def digest(data: bytes) -> str:
    """A wheel RECORD hash: urlsafe base64 of the SHA-256, without padding."""
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def tiny_wheel(dest: Path) -> Path:
    """Write ``ramet_tiny-1.0-py3-none-any.whl`` (a module and a console script) into ``dest``."""
    dist = "ramet_tiny-1.0.dist-info"
    files = {
        "ramet_tiny/__init__.py": b"VALUE = 42\n\ndef main():\n    print('tiny', VALUE)\n",
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: ramet-tiny\nVersion: 1.0\n",
        f"{dist}/WHEEL": (b"Wheel-Version: 1.0\nGenerator: rametfs-tests\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
        f"{dist}/entry_points.txt": b"[console_scripts]\nramet-tiny = ramet_tiny:main\n",
    }
    record = "".join(f"{name},sha256={digest(data)},{len(data)}\n"
                     for name, data in files.items()) + f"{dist}/RECORD,,\n"
    path = dest / "ramet_tiny-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{dist}/RECORD", record)
    return path


def test_virtualenv_and_pip_install_of_a_wheel(executions, tmp_path):
    src = write_tree(tmp_path / "src", {"app/main.py": b"import ramet_tiny\n"
                                                       b"print(ramet_tiny.VALUE * 2)\n"})
    ex = executions(src)
    wheel = tiny_wheel(tmp_path)
    venv_python = ex / "venv" / "bin" / "python"
    site = ex / "venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" \
        / "site-packages"

    def pip(*args: str) -> str:
        return run(sys.executable, "-m", "pip", "--python", venv_python, "--no-input",
                   "--disable-pip-version-check", *args).stdout

    run(sys.executable, "-m", "venv", "--without-pip", ex / "venv")
    pip("install", "--no-index", "--no-deps", "--root-user-action=ignore", wheel)

    assert run(venv_python, ex / "app" / "main.py").stdout == "84\n"
    assert run(ex / "venv" / "bin" / "ramet-tiny").stdout == "tiny 42\n"
    assert run(venv_python, "-c", "import ramet_tiny, sys; print(ramet_tiny.__file__, "
               "sys.prefix)").stdout == f"{site / 'ramet_tiny' / '__init__.py'} {ex / 'venv'}\n"
    assert "ramet-tiny==1.0" in pip("list", "--format=freeze").splitlines()
    assert sorted(os.listdir(site / "ramet_tiny")) == ["__init__.py", "__pycache__"]
    assert os.access(ex / "venv" / "bin" / "ramet-tiny", os.X_OK)
    pip("uninstall", "-y", "--root-user-action=ignore", "ramet-tiny")
    assert not os.path.lexists(site / "ramet_tiny")
    assert not os.path.lexists(ex / "venv" / "bin" / "ramet-tiny")
    assert run(venv_python, "-c", "import ramet_tiny", check=False).returncode == 1


def test_compileall(executions, tmp_path):
    src = write_tree(tmp_path / "src", {
        "pkg/__init__.py": b"", "pkg/a.py": b"A = 6 * 7\n",
        "pkg/sub/__init__.py": b"from pkg.a import A\n",
        "pkg/sub/b.py": b"from pkg.sub import A\nB = A + 1\n"})
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SOURCE_DATE_EPOCH", "PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    sources = ["pkg/__init__.py", "pkg/a.py", "pkg/sub/__init__.py", "pkg/sub/b.py"]
    caches = [Path(importlib.util.cache_from_source(s)) for s in sources]

    def steps(root: Path) -> list:
        run(sys.executable, "-m", "compileall", "-q", "-j", "2", "pkg", cwd=root, env=env)
        pycs = [(root / c).read_bytes() for c in caches]
        mtimes = [os.stat(root / c).st_mtime_ns for c in caches]
        run(sys.executable, "-m", "compileall", "-q", "pkg", cwd=root, env=env)  # up to date
        out = run(sys.executable, "-c", "import pkg.sub.b as b; print(b.B, b.__cached__)",
                  cwd=root, env=env).stdout
        return [pycs, [os.stat(root / c).st_mtime_ns for c in caches] == mtimes,
                out.replace(str(root), "ROOT")]

    got = steps(ex)
    assert got == steps(ext4)
    assert got[1:] == [True, f"43 ROOT/{caches[3]}\n"]


# ----- C: gcc and make ----------------------------------------------------------------------------

C_SOURCES = {
    "c/util.h": b"int triple(int x);\n",
    "c/util.c": b'#include "util.h"\nint triple(int x) { return 3 * x; }\n',
    "c/main.c": (b'#include <stdio.h>\n#include "util.h"\n'
                 b'int main(int argc, char **argv) {\n'
                 b'    printf("triple(%d) = %d\\n", argc, triple(argc));\n    return 0;\n}\n'),
    "c/Makefile": (b"hello: main.o util.o\n\t$(CC) -o $@ main.o util.o\n"
                   b"%.o: %.c util.h\n\t$(CC) -O2 -Wall -Werror -c -o $@ $<\n"),
}


def test_gcc_and_make(executions, tmp_path):
    src = write_tree(tmp_path / "src", C_SOURCES)
    ex, ext4 = executions(src), ext4_copy(src, tmp_path / "ext4")
    env = {"PATH": os.environ["PATH"], "LC_ALL": "C", "CC": "gcc"}

    def steps(root: Path) -> list:
        built = run("make", "-C", root / "c", "--no-print-directory", env=env).stdout
        again = run("make", "-C", root / "c", "--no-print-directory", env=env).stdout
        direct = root / "c" / "direct"
        run("gcc", "-O2", "-o", direct, "main.c", "util.c", cwd=root / "c", env=env)
        return [built, again, run(root / "c" / "hello", "a", "b").stdout,
                run(direct).stdout, (root / "c" / "hello").read_bytes(),
                oct(os.stat(root / "c" / "hello").st_mode)]

    got = steps(ex)
    assert got == steps(ext4)
    assert got[:4] == [
        "gcc -O2 -Wall -Werror -c -o main.o main.c\ngcc -O2 -Wall -Werror -c -o util.o util.c\n"
        "gcc -o hello main.o util.o\n",
        "make: 'hello' is up to date.\n", "triple(3) = 9\n", "triple(1) = 3\n"]
    assert got[5] == "0o100755"


# ----- tar and cp -a round trips ------------------------------------------------------------------

TIMES_NS = (1_600_000_000_111_222_333, 1_500_000_000_444_555_666)  # (atime, mtime)
TAR = ["tar", "--format=posix", "--xattrs", "--xattrs-include=user.*", "--numeric-owner"]


@pytest.fixture
def rich_tree(tmp_path) -> Path:
    """``src/tree``: modes, owners, ns mtimes, user xattrs, symlinks, hard links, empty dirs."""
    src = write_tree(tmp_path / "src", {
        "tree/plain": b"plain\n", "tree/private": b"private\n", "tree/script.sh": b"#!/bin/sh\n",
        "tree/setuid": b"s", "tree/readonly": b"r", "tree/empty": b"",
        "tree/owned": b"owned\n", "tree/big.bin": os.urandom(200_000),
        "tree/dir/a": b"a\n", "tree/dir/deep/b": b"b\n", "tree/secret/c": b"c\n",
        "tree/shared/d": b"d\n", "tree/links/one": b"linked\n"})
    tree = src / "tree"
    (tree / "empty-dir").mkdir()
    for rel, mode in [("private", 0o600), ("script.sh", 0o755), ("setuid", 0o4755),
                      ("readonly", 0o444), ("secret", 0o700), ("shared", 0o2775)]:
        os.chmod(tree / rel, mode)
    os.chown(tree / "owned", 1234, 5678)
    os.chown(tree / "shared", 0, 4321)
    os.setxattr(tree / "plain", "user.color", b"blue")
    os.setxattr(tree / "plain", "user.bin", b"\x00\xff")
    os.setxattr(tree / "dir", "user.kind", b"directory")
    os.link(tree / "links" / "one", tree / "links" / "two")
    os.link(tree / "links" / "one", tree / "dir" / "three")
    os.link(tree / "plain", tree / "dir" / "deep" / "plain-again")
    os.symlink("dir/a", tree / "rel-link")
    os.symlink("/etc/hostname", tree / "abs-link")
    os.symlink("missing", tree / "dangling")
    os.symlink("dir", tree / "dir-link")
    for path in sorted(tree.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        os.utime(path, ns=TIMES_NS, follow_symlinks=False)
    os.utime(tree, ns=TIMES_NS)
    return src


def test_tar_round_trips(executions, rich_tree, tmp_path):
    ex = executions(rich_tree)
    expected = tree_signature(rich_tree / "tree")
    assert sum("links=" in line for line in expected.values()) == 5

    run(*TAR, "-C", ex, "-cf", ex / "tree.tar", "tree")  # archive written into the execution
    (ex / "untar").mkdir()
    run(*TAR, "-C", ex / "untar", "-xpf", ex / "tree.tar")
    assert tree_signature(ex / "untar" / "tree") == expected
    run(*TAR, "-C", ex / "untar", "-cf", tmp_path / "again.tar", "tree")
    (tmp_path / "on-ext4").mkdir()
    run(*TAR, "-C", tmp_path / "on-ext4", "-xpf", tmp_path / "again.tar")
    assert tree_signature(tmp_path / "on-ext4" / "tree") == expected
    run(*TAR, "-C", rich_tree, "-cf", tmp_path / "from-ext4.tar", "tree")
    (ex / "from-ext4").mkdir()
    run(*TAR, "-C", ex / "from-ext4", "-xpf", tmp_path / "from-ext4.tar")
    assert tree_signature(ex / "from-ext4" / "tree") == expected
    listing = sorted(run("tar", "-tf", ex / "tree.tar").stdout.splitlines())
    assert listing == sorted(run("tar", "-tf", tmp_path / "from-ext4.tar").stdout.splitlines())
    assert len(listing) == len(expected)


def test_cp_a_round_trips(executions, rich_tree, tmp_path):
    ex = executions(rich_tree)
    expected = tree_signature(rich_tree / "tree")

    run("cp", "-a", ex / "tree", ex / "copy")  # within the execution
    assert tree_signature(ex / "copy") == expected
    run("cp", "-a", ex / "copy", tmp_path / "out")  # execution -> ext4
    assert tree_signature(tmp_path / "out") == expected
    run("cp", "-a", tmp_path / "out", ex / "back")  # ext4 -> execution
    assert tree_signature(ex / "back") == expected
    run("diff", "-r", "--no-dereference", ex / "tree", ex / "back")


# ----- rm -rf of a large tree ---------------------------------------------------------------------

def test_rm_rf_of_a_large_tree(executions, tmp_path):
    files = {f"big/d{d:02d}/e{e}/f{n:03d}": f"{d}.{e}.{n}\n".encode()
             for d in range(30) for e in range(2) for n in range(50)}
    src = write_tree(tmp_path / "src", files | {"keep/k": b"k"})
    for d in range(30):
        os.symlink("../../keep", src / "big" / f"d{d:02d}" / "e0" / "to-keep")
        os.link(src / "keep" / "k", src / "big" / f"d{d:02d}" / "k-link")
    ex = executions(src)
    for d in range(0, 30, 3):  # some of it changed inside the execution
        (ex / "big" / f"d{d:02d}" / "new").mkdir()
        for n in range(20):
            (ex / "big" / f"d{d:02d}" / "new" / f"n{n}").write_bytes(b"n")
        (ex / "big" / f"d{d:02d}" / "e1" / "f000").write_bytes(b"changed")
        os.rename(ex / "big" / f"d{d:02d}" / "e0", ex / "big" / f"d{d:02d}" / "e0-moved")
    assert run("find", ex / "big", "-type", "f").stdout.count("\n") == 3000 + 30 + 200

    run("rm", "-rf", ex / "big")
    assert os.listdir(ex) == ["keep"]
    assert (ex / "keep" / "k").read_bytes() == b"k"
    assert os.stat(ex / "keep" / "k").st_nlink == 1
    os.mkdir(ex / "big")
    assert os.listdir(ex / "big") == []
