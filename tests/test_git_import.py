"""Git import (``snapshot-git``): a revision's tree from the repository's objects, and the
repository's ``.git`` travelling with it.

The expected tree of a revision is ``git archive REV | tar -x`` (with ``tar.umask`` 0022, the
modes a checkout gives under umask 022), read by :func:`tree_signature` like every mounted
test: types, modes, owner, link counts, mtimes, bytes and symlink targets.  The store-level
tests at the end need no mount.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ctl_command, run
from rametfs import Ramet, RametError, errors, protocol
from rametfs.store import Store, import_git
from test_snapshots import SNAPSHOT_ID, tree_signature, write_tree

DATES = ("2024-01-01T10:00:00Z", "2024-01-02T10:00:00Z", "2024-01-03T10:00:00Z")
REVS = ("HEAD~2", "HEAD~1", "main")
BIG_BYTES = 200_000  # four pages


def git_env(home: Path, date: str = DATES[-1]) -> dict:
    """An environment for reproducible git commands: no user or system config."""
    return {**os.environ, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "Test",
            "GIT_AUTHOR_EMAIL": "test@example.com", "GIT_COMMITTER_NAME": "Test",
            "GIT_COMMITTER_EMAIL": "test@example.com", "GIT_AUTHOR_DATE": date,
            "GIT_COMMITTER_DATE": date}


def git(cwd: str | os.PathLike, *args: str, date: str = DATES[-1]) -> str:
    return run("git", *args, cwd=cwd, env=git_env(Path(cwd), date)).stdout


def commit(repo: Path, message: str, date: str) -> None:
    git(repo, "add", "-A", date=date)
    git(repo, "commit", "-q", "-m", message, date=date)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """Three commits on ``main`` (files, an executable, a 4-page binary, symlinks, a
    submodule), a local branch ``feature`` one commit ahead, one stash entry; clean."""
    repo = write_tree(tmp_path_factory.mktemp("git") / "repo", {
        "README.md": b"# project\n",
        "src/app.py": b"print('v1')\n",
        "bin/run.sh": b"#!/bin/sh\necho run\n",
        "data/big.bin": os.urandom(BIG_BYTES),
        "name with space.txt": b"spaces\n",
        "empty": b"",
    })
    os.chmod(repo / "bin" / "run.sh", 0o755)
    os.symlink("README.md", repo / "readme-link")
    os.symlink("nowhere/at/all", repo / "dangling")
    git(repo, "init", "-q", "-b", "main")
    (repo / "vendor" / "lib").mkdir(parents=True)  # where a submodule is not checked out
    git(repo, "update-index", "--add", "--cacheinfo",
        "160000,1234567890123456789012345678901234567890,vendor/lib")
    commit(repo, "first", DATES[0])
    (repo / "src" / "app.py").write_bytes(b"print('v2')\n")
    write_tree(repo, {"docs/guide.md": b"read me\n"})
    commit(repo, "second", DATES[1])
    os.unlink(repo / "name with space.txt")
    os.chmod(repo / "src" / "app.py", 0o755)
    os.unlink(repo / "readme-link")
    os.symlink("docs/guide.md", repo / "readme-link")
    commit(repo, "third", DATES[2])
    git(repo, "checkout", "-q", "-b", "feature")
    (repo / "feature.txt").write_bytes(b"local work\n")
    commit(repo, "local commit", DATES[2])
    git(repo, "checkout", "-q", "main")
    (repo / "README.md").write_bytes(b"# project, being edited\n")
    git(repo, "stash", "push", "-q", "-m", "wip")
    assert git(repo, "status", "--porcelain") == ""
    return repo


def archive(repo: Path, rev: str, dest: Path) -> Path:
    """``git archive rev | tar -x`` into ``dest``, whose own mode and mtime are set as the
    snapshot's root gets them (0755, the commit time)."""
    dest.mkdir(parents=True)
    tar = dest.with_name(dest.name + ".tar")
    git(repo, "-c", "tar.umask=0022", "archive", "-o", str(tar), rev)
    run("tar", "-x", "-C", dest, "-f", tar)
    when = int(git(repo, "log", "-1", "--format=%ct", rev))
    os.chmod(dest, 0o755)
    os.utime(dest, (when, when))
    return dest


def git_state(tree: Path) -> dict[str, str]:
    """What the local state of a repository shows: status, log of every ref, branches,
    stash, staged and unstaged diffs, and a full object check."""
    return {"status": git(tree, "status", "--porcelain"),
            "log": git(tree, "log", "--all", "--format=%H %D %s"),
            "branches": git(tree, "branch", "-a", "-v"),
            "stash": git(tree, "stash", "list"),
            "stash show": git(tree, "stash", "show", "-p", "stash@{0}"),
            "staged": git(tree, "diff", "--cached"),
            "unstaged": git(tree, "diff"),
            "fsck": git(tree, "fsck", "--no-dangling")}


# ----- through the mount ------------------------------------------------------------------------

def test_each_revision_equals_git_archive(shared_daemon, repo, tmp_path):
    ramet = Ramet(shared_daemon.mnt)
    for rev in REVS:
        snapshot = ramet.snapshot_git(repo, rev=rev, label=rev)
        assert SNAPSHOT_ID.fullmatch(snapshot)
        ex = ramet.create(snapshot)
        expected = tree_signature(archive(repo, rev, tmp_path / rev))
        assert tree_signature(ex.path) == expected
        assert tree_signature(shared_daemon.snap_path(snapshot)) == expected
        assert os.readlink(ex.path / "readme-link") == (
            "docs/guide.md" if rev == "main" else "README.md")
        assert os.listdir(ex.path / "vendor" / "lib") == []  # the submodule
        ramet.release(ex)
    record, = [s for s in ramet.snapshots() if s["id"] == snapshot]
    assert record["source"] == f"{repo}@{git(repo, 'rev-parse', 'main').strip()}"
    assert (record["label"], record["git_submodules"], record["git_dir"]) == ("main", 1, False)


def test_git_state_survives_promote_restart_and_restore(daemon, repo):
    ramet = Ramet(daemon.mnt)
    source_state = git_state(repo)
    ex = ramet.create(ramet.snapshot_git(repo, with_git_dir=True))
    # The index's stat data are the source's: status re-reads the files and says clean.
    assert git_state(ex.path) == source_state
    assert source_state["status"] == "" and "stash@{0}: On main: wip" in source_state["stash"]
    assert "local commit" in source_state["log"]

    # More local state, made in the execution: a commit, a staged file, a second stash.
    (ex.path / "src" / "new.py").write_bytes(b"print('new')\n")
    git(ex.path, "add", "src/new.py")
    git(ex.path, "commit", "-q", "-m", "made in the execution")
    (ex.path / "README.md").write_bytes(b"# stashed in the execution\n")
    git(ex.path, "stash", "push", "-q", "-m", "second wip")
    (ex.path / "staged.txt").write_bytes(b"staged, not committed\n")
    git(ex.path, "add", "staged.txt")
    state = git_state(ex.path)
    assert state["status"] == "A  staged.txt\n"
    assert state["stash"].splitlines()[0] == "stash@{0}: On main: second wip"

    promoted = ex.promote(label="with local git state")
    assert git_state(ex.path) == state
    daemon.restart()
    assert git_state(ex.path) == state
    restored = ramet.create(promoted)
    assert git_state(restored.path) == state
    assert git_state(repo) == source_state  # the source repository is untouched


def test_errors_carry_their_errno(shared_daemon, repo, tmp_path):
    ctl = shared_daemon.mnt / protocol.CONTROL_DIR / protocol.CTL
    cases = [
        (protocol.format_command("snapshot-git", str(repo), rev="no-such-rev"), errno.ENOENT,
         "no commit 'no-such-rev'"),
        (protocol.format_command("snapshot-git", str(tmp_path)), errno.EINVAL,
         "is not a git repository"),
        (protocol.format_command("snapshot-git", str(tmp_path / "missing")), errno.ENOENT,
         "does not exist"),
        (protocol.format_command("snapshot-git", "relative/repo"), errno.EINVAL,
         "is not absolute"),
        (protocol.format_command("snapshot-git", str(repo), gitdir="maybe"), errno.EINVAL,
         "--gitdir takes yes or no, not 'maybe'"),
    ]
    for line, code, words in cases:
        with pytest.raises(OSError) as failure:
            ctl_command(ctl, line)
        assert failure.value.errno == code, line
        assert words in failure.value.reply["error"], failure.value.reply
    with pytest.raises(RametError) as failure:
        Ramet(shared_daemon.mnt).snapshot_git(repo, rev="HEAD~9")
    assert failure.value.errno == errno.ENOENT


def test_cli_snapshot_git(shared_daemon, repo):
    cli = [sys.executable, "-m", "rametfs", "snapshot", "-m", str(shared_daemon.mnt)]
    out = run(*cli, "--git", repo, "--rev", "HEAD~1", "--label", "cli").stdout
    assert SNAPSHOT_ID.fullmatch(out.strip())
    record, = [s for s in Ramet(shared_daemon.mnt).snapshots() if s["id"] == out.strip()]
    assert record["git_commit"] == git(repo, "rev-parse", "HEAD~1").strip()
    usage = run(*cli, repo, "--with-git-dir", check=False)
    assert (usage.returncode, usage.stdout) == (2, "")
    assert "--rev and --with-git-dir need --git" in usage.stderr


def test_fallback_mode_imports_from_the_store(repo, tmp_path):
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        ex = ramet.create(ramet.snapshot_git(repo, rev="HEAD~1"))
        assert tree_signature(ex.path) == tree_signature(archive(repo, "HEAD~1", tmp_path / "a"))
        with_git = ramet.create(ramet.snapshot_git(repo, with_git_dir=True))
        assert git_state(with_git.path) == git_state(repo)
        with pytest.raises(RametError) as failure:
            ramet.snapshot_git(repo, rev="no-such-rev")
        assert failure.value.errno == errno.ENOENT


# ----- the store, no mount ----------------------------------------------------------------------

def blob_pages(repo: Path, rev: str) -> set[bytes]:
    """Every distinct page (64 KiB) of the regular files of ``rev``."""
    pages = set()
    for line in git(repo, "ls-tree", "-r", "-z", rev).split("\0"):
        if line.startswith("100"):
            data = run_bytes(repo, "cat-file", "blob", line.split()[2])
            pages.update(data[i:i + 65536] for i in range(0, len(data), 65536))
    return pages


def run_bytes(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True).stdout


def test_successive_revisions_share_unchanged_chunks(repo, tmp_path):
    store = Store(tmp_path / "data")
    try:
        seen: set[bytes] = set()
        stats = []
        for rev in REVS:
            pages = blob_pages(repo, rev)
            snap = import_git(store, repo, rev)
            assert snap.stats["new_chunks"] == len(pages - seen), rev
            seen |= pages
            stats.append(snap.stats)
        # Only the second and third commits' small edits were stored again.
        assert [s["cached_files"] for s in stats] == [0, 5, 6]
        assert stats[0]["new_chunk_bytes"] > BIG_BYTES
        assert stats[1]["new_chunk_bytes"] + stats[2]["new_chunk_bytes"] < 200
        again = import_git(store, repo, "main")
        assert (again.stats["new_chunks"], again.stats["cached_files"]) == (0, 6)
        assert again.root == snap.root  # the same tree, so the same root tree id
        assert stats[2]["git_commit"] == git(repo, "rev-parse", "main").strip()
    finally:
        store.close()


def test_bare_repository_and_reserved_names(repo, tmp_path):
    bare = tmp_path / "bare.git"
    git(tmp_path, "clone", "-q", "--bare", str(repo), str(bare))
    store = Store(tmp_path / "data")
    try:
        assert import_git(store, bare, "main").root == import_git(store, repo, "main").root
        with pytest.raises(errors.RametError) as failure:
            import_git(store, bare, with_git_dir=True)
        assert failure.value.errno == errno.EINVAL
        reserved = write_tree(tmp_path / "reserved", {".ramet": b"not ours\n"})
        git(reserved, "init", "-q")
        commit(reserved, "holds .ramet", DATES[0])
        with pytest.raises(errors.RametError) as failure:
            import_git(store, reserved)
        assert failure.value.errno == errno.EINVAL
        assert "reserves" in str(failure.value)
    finally:
        store.close()
