"""git's fsmonitor hook answered by rametfs (``.ramet/fsmonitor``): git status with the hook
must say exactly what git status without it says, while the hook names only what changed."""

from __future__ import annotations

import os
import subprocess

from conftest import ctl_command, run

GIT = ("git", "-c", "user.email=test@example.com", "-c", "user.name=test")


def hook(workdir, token: str) -> tuple[str, list[str]]:
    """Run the execution's hook from ``workdir`` as git does; (new token, paths)."""
    hook_path = next(p for p in [workdir, *workdir.parents] if (p / ".ramet").exists())
    out = subprocess.run([hook_path / ".ramet" / "fsmonitor", "2", token], cwd=workdir,
                         capture_output=True, check=True).stdout
    assert out.endswith(b"\0")
    new, *paths = out[:-1].decode().split("\0")
    return new, paths


def status(repo, *config: str) -> str:
    return run(*GIT, *config, "status", "--porcelain", "--untracked-files=all", cwd=repo).stdout


def test_git_status_with_the_hook_equals_git_status_without(shared_daemon, tmp_path):
    src = tmp_path / "src"
    for i in range(40):
        (src / f"d{i % 4}").mkdir(parents=True, exist_ok=True)
        (src / f"d{i % 4}" / f"f{i}.txt").write_text(f"file {i}\n")
    run(*GIT, "init", "-q", cwd=src)
    run(*GIT, "add", "-A", cwd=src)
    run(*GIT, "commit", "-qm", "init", cwd=src)
    ex = shared_daemon.exec_path(shared_daemon.create(shared_daemon.snapshot(src)))
    # Relative to the work tree, so the setting still holds in a promoted copy.
    monitor = ("-c", "core.untrackedCache=true", "-c", "core.fsmonitor=.ramet/fsmonitor")

    token, paths = hook(ex, "")
    assert paths == ["/"]  # no token yet: everything may have changed
    assert status(ex, *monitor) == status(ex) == ""
    token, paths = hook(ex, token)
    assert paths == []

    (ex / "d1" / "f1.txt").write_text("changed\n")
    (ex / "d2" / "new.txt").write_text("new\n")
    (ex / "d3" / "f3.txt").unlink()
    (ex / "d0" / "f0.txt").rename(ex / "d0" / "moved.txt")
    (ex / "d1" / "f5.txt").chmod(0o755)
    token, paths = hook(ex, token)
    assert paths == ["d0/f0.txt", "d0/moved.txt", "d1/f1.txt", "d1/f5.txt", "d2/new.txt",
                     "d3/f3.txt"]
    expected = ("?? d0/moved.txt\n?? d2/new.txt\n M d1/f1.txt\n M d1/f5.txt\n D d0/f0.txt\n"
                " D d3/f3.txt\n")
    assert sorted(status(ex, *monitor).splitlines()) == sorted(expected.splitlines())
    assert status(ex, *monitor) == status(ex)

    # A work tree below the execution root gets paths relative to itself.
    sub = ex / "d2"
    token, _ = hook(sub, token)
    (ex / "d2" / "f2.txt").write_text("changed\n")
    (ex / "d1" / "f9.txt").write_text("changed\n")
    assert hook(sub, token)[1] == ["f2.txt"]

    # A reset makes every old token mean "rescan everything" (so does another daemon run).
    ctl_command(ex / ".ramet" / "ctl", "reset")
    assert hook(ex, token)[1] == ["/"]
    assert status(ex, *monitor) == status(ex) == ""


def test_many_changes_and_a_deep_path_are_answered_exactly(shared_daemon, tmp_path):
    """The answer is made in steps (runs of 1,024 changes sorted, then merged; a path's
    parents walked 1,024 at a time): 3,000 files in three new directories, 1,500 new
    directories in a chain and a file at its bottom come back sorted, each once, relative
    to the work tree."""
    src = tmp_path / "src"
    src.mkdir()
    ex = shared_daemon.exec_path(shared_daemon.create(shared_daemon.snapshot(src)))
    token, _ = hook(ex, "")
    names = []
    for i in range(3000):
        directory = ex / f"d{i % 3}"
        directory.mkdir(exist_ok=True)
        (directory / f"f{i:04d}").write_bytes(b"")
        names.append(f"d{i % 3}/f{i:04d}")
    fd = os.open(ex, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(1500):  # relative steps: the whole path is past PATH_MAX
            os.mkdir("e", dir_fd=fd)
            fd, old = os.open("e", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
            os.close(old)
        os.close(os.open("deep", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    finally:
        os.close(fd)
    token, paths = hook(ex, token)
    made = ["d0", "d1", "d2"] + ["/".join(["e"] * n) for n in range(1, 1501)]
    assert paths == sorted(names + made + ["e/" * 1500 + "deep"])
    sub = ex / "d1"
    (sub / "f0001").write_bytes(b"changed")
    (ex / "d2" / "f0002").write_bytes(b"changed")
    assert hook(sub, token)[1] == ["f0001"]


def test_a_token_tells_nothing_of_other_executions(shared_daemon, tmp_path):
    """Each execution counts its own changes: a daemon-wide clock in the token let an agent
    count what every other execution changed between two queries."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("f\n")
    snap = shared_daemon.snapshot(src)
    agent, other = (shared_daemon.exec_path(shared_daemon.create(snap)) for _ in range(2))
    token, _ = hook(agent, "")
    for i in range(50):
        (other / f"n{i}").write_text("n\n")
    assert hook(agent, token) == (token, [])
    (agent / "f").write_text("changed\n")
    assert hook(agent, token)[1] == ["f"]
