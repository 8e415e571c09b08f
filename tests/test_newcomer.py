"""As a newcomer meets rametfs: the README run as written, set-up, the CLI and its errors.

Every test goes through the real CLI (``python -m rametfs``) and real kernel mounts.  The
README test runs each shell and Python block of README.md as written, in order, in one bash
session inside a private mount namespace whose ``/mnt`` and ``/var/lib`` are tmpfs (so the
README's own paths, ``/mnt/ramet`` and ``/var/lib/rametfs``, are used and nothing of the
host's is touched), with ``HOME`` a temporary directory holding ``~/project``, a small git
repository on git's default branch, and a directory named ``rametfs`` beside the Python
scripts (a clone of this repository would be one).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import termios
import threading
import time
import tomllib
from pathlib import Path

import pytest

from conftest import (Daemon, ctl_command, pid_alive, require_bwrap, require_fuse, run, serving,
                      wait_until)
from rametfs import protocol
from rametfs.cli import EXIT_CODES
from rametfs.mounts import copies_elsewhere, mount_at, served_by
from rametfs.core.policy import load as load_policy

ROOT = Path(__file__).resolve().parent.parent
RAMETFS = (sys.executable, "-m", "rametfs")
NOBODY = 65534
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
# README blocks not run, by their first line, and why.
NOT_RUN = {
    "tools/demo": "the demo snapshots the standard library (minutes); tools/demo runs it",
    "tools/test": "the test suite itself",
    "pip install": "pip needs the package index and minutes; tools/setup does this install",
}
README_TIMEOUT_S = 180


def cli(*args: str | os.PathLike, env: dict | None = None, cwd=None,
        user: int | None = None) -> subprocess.CompletedProcess:
    """The real CLI, never raising; ``env`` adds to (None values remove from) os.environ."""
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return run(*RAMETFS, *args, env=full, cwd=cwd, check=False, user=user)


def no_traceback(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """A daemon of this module's own (its log is checked at the end)."""
    with serving(tmp_path_factory.mktemp("newcomer")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def snap(d, tmp_path_factory) -> str:
    src = write_tree(tmp_path_factory.mktemp("src"), {"a.txt": "alpha\n", "sub/b.txt": "b\n"})
    return d.snapshot(src)


# ----- the README, as written -----------------------------------------------------------------

def readme_blocks() -> list[tuple[str, str]]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def make_project(home: Path) -> None:
    """~/project: a git repository on git's default branch (master, no init.defaultBranch),
    with a module and its unittest; and ~/rametfs, as a clone next to the scripts."""
    project = write_tree(home / "project", {
        "app.py": "def add(a, b):\n    return a + b\n",
        "test_app.py": "import unittest\n\nfrom app import add\n\n\n"
                       "class T(unittest.TestCase):\n    def test_add(self):\n"
                       "        self.assertEqual(add(2, 3), 5)\n"})
    git = ["git", "-c", "user.name=newcomer", "-c", "user.email=n@example.invalid"]
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "first"]):
        run(*git, *args, cwd=project, env=env)
    assert run("git", "branch", "--show-current", cwd=project, env=env).stdout == "master\n"
    write_tree(home / "rametfs", {"README.md": "a clone of rametfs\n"})


def readme_script(home: Path) -> tuple[str, list[str]]:
    """The bash script that runs the README's blocks in order, and the reasons of the
    blocks it leaves out."""
    lines = ["set -euo pipefail",
             # The namespace's copies of FUSE mounts would keep their daemons serving after
             # their unmount elsewhere (rametfs umount waits, then says so): drop them.
             "awk '{for (i = 7; i <= NF; i++) if ($i == \"-\") { if ($(i + 1) ~ /^fuse/) "
             "print $5; break }}' /proc/self/mountinfo | sort -r | "
             "while read -r point; do umount -l \"$point\" 2>/dev/null || true; done",
             "mount -t tmpfs -o mode=0755 tmpfs /mnt && mount -t tmpfs -o mode=0755 tmpfs /var/lib",
             # A failed block must not leave the daemon running in the namespace.
             "trap 'if mountpoint -q /mnt/ramet; then pid=$(python3 -c \"import json; "
             "print(json.load(open(\\\"/mnt/ramet/.ramet/status\\\"))[\\\"pid\\\"])\"); "
             "rametfs umount /mnt/ramet || { fusermount3 -u -z /mnt/ramet; kill $pid; }; fi' EXIT",
             f"cd {home}"]
    skipped = []
    for i, (lang, body) in enumerate(readme_blocks()):
        first = body.strip().splitlines()[0] if body.strip() else ""
        reason = next((why for start, why in NOT_RUN.items() if first.startswith(start)), None)
        if lang not in ("sh", "python"):
            continue
        if reason is not None:
            skipped.append(f"{first}: {reason}")
        elif lang == "sh":
            lines += [f"echo '### block {i}' >&2", body]
        else:
            script = home / f"readme-{i}.py"
            script.write_text(body)
            lines += [f"echo '### block {i}' >&2", f"(cd {home} && python3 {script.name})"]
    return "\n".join(lines) + "\n", skipped


def test_readme_blocks_run_as_written(tmp_path):
    require_fuse()
    require_bwrap()
    home = tmp_path / "home"
    make_project(home)
    script, skipped = readme_script(home)
    (tmp_path / "readme.sh").write_text(script)
    assert len(skipped) == len(NOT_RUN)  # the quick start's two commands and pip's block
    env = {"HOME": str(home), "LANG": "C.UTF-8",
           "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin"}
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash",
                           str(tmp_path / "readme.sh")], env=env, text=True,
                          capture_output=True, timeout=README_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    out = proc.stdout
    assert re.search(r"^passed: [0-9a-f]{64}$", out, re.M), out  # the sandbox's unittest
    assert re.search(r"^[0-9a-f]{64}$", out, re.M), out  # the quick start's promote
    assert "frobnicate: unknown command 'frobnicate'" in out  # .ramet/error, shown by cat
    assert "A hello.py\n" in out  # .ramet/diff, and rametfs diff
    assert "mode: open-less" in out or "mode: plain" in out


def test_readme_policy_is_the_offline_recipe_and_parses():
    tomls = [body for lang, body in readme_blocks() if lang == "toml"]
    assert len(tomls) == 1
    policy = load_policy(tomls[0].encode(), "README.md")
    recipe = policy.recipes["venv"]
    assert "--no-index" in recipe.command[-1] and "wheels" in recipe.inputs
    assert tomllib.loads(tomls[0])["ephemeral"] == ["*.log", "tmp/"]


def test_a_script_next_to_a_clone_imports_the_package(tmp_path):
    # Saved next to a clone named rametfs/ (no __init__.py: a namespace package to Python),
    # the quick start's import still finds the installed package (tools/setup installs the
    # checkout editable with a path entry, which wins over a namespace directory).
    write_tree(tmp_path, {"rametfs/README.md": "a clone\n",
                          "quick.py": "from rametfs import Ramet\nprint(Ramet.__module__)\n"})
    proc = run(sys.executable, "quick.py", cwd=tmp_path)
    assert proc.stdout == "rametfs.client\n"


# ----- 1. plain mode is said, and how to leave it ------------------------------------------

def test_plain_mode_is_said_by_mount_ls_status_and_the_log(tmp_path):
    require_fuse()
    d = Daemon(tmp_path / "data", tmp_path / "mnt", env={"RAMETFS_OPEN_LESS": "0"})
    (tmp_path / "mnt").mkdir()
    mounted = cli("mount", "--data", d.data_dir, d.mnt, "--background",
                  env={"RAMETFS_OPEN_LESS": "0"})
    try:
        assert mounted.returncode == 0, mounted.stderr
        note, = mounted.stderr.splitlines()
        assert note.startswith("rametfs: plain mode (RAMETFS_OPEN_LESS=0 is set): warm git "
                               "status is 5-10x slower and cold 2x")
        assert "rametfs build-pyfuse3" in note
        listing = cli("ls", "-m", d.mnt)
        assert listing.stdout.splitlines()[0] == (
            f"mount: {d.mnt}  mode: plain (slower; see rametfs build-pyfuse3 --help)")
        status = cli("status", "-m", d.mnt)
        assert json.loads(status.stdout)["open_less"] is False
        assert status.stderr == ("rametfs: the daemon runs in mode plain (slower; see rametfs "
                                 "build-pyfuse3 --help)\n")
        log = (d.data_dir / "daemon.log").read_text()
        assert "(pid " in log and ", plain mode)" in log and note[len("rametfs: "):] in log
    finally:
        assert cli("umount", d.mnt).returncode == 0


def test_open_less_mode_says_nothing_and_ls_names_it(d):
    assert cli("mount", "--help").returncode == 0
    listing = cli("ls", "-m", d.mnt)
    assert (listing.stdout.splitlines()[0], listing.stderr) == (
        f"mount: {d.mnt}  mode: open-less", "")
    assert cli("status", "-m", d.mnt).stderr == ""


def test_the_patch_ships_in_the_wheel_for_build_pyfuse3(tmp_path):
    # rametfs build-pyfuse3 works from a pip install: the patch is package data.  Built
    # from a copy, as setuptools builds in the source tree.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "rametfs", source / "rametfs",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source)
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
        "-w", tmp_path, source)
    wheel, = tmp_path.glob("rametfs-*.whl")
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", wheel], text=True,
                           capture_output=True, check=True).stdout
    assert "rametfs/pyfuse3-open-less.patch" in names and "rametfs/pyfuse3_build.py" in names
    help_text = cli("build-pyfuse3", "--help").stdout
    assert "open-less" in help_text and "libfuse3-dev" in help_text


def test_extras_and_set_up_install_the_heavy_frameworks_only_for_tests():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert extras["git"] == ["pygit2>=1.15"] and extras["demo"] == ["tqdm>=4.66"]
    assert {e.split(">")[0] for e in extras["harness"]} == {
        "skyrl-gym", "langgraph", "langgraph-checkpoint-sqlite"}
    assert "tools/setup demo\n" in (ROOT / "tools" / "demo").read_text()
    assert "tools/setup demo\n" in (ROOT / "tools" / "demo-best-of-n").read_text()
    assert "tools/setup test harness\n" in (ROOT / "tools" / "test").read_text()
    # Nothing to do: set-up says nothing, and returns at once.
    stamp = (ROOT / ".venv" / ".rametfs-setup-stamp")
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text().split()[:1] != [digest]:
        pytest.skip("this .venv was set up from another pyproject.toml: run tools/setup")
    started = time.monotonic()
    done = run(ROOT / "tools" / "setup", "test", "harness")
    assert (done.stdout, done.stderr) == ("", "") and time.monotonic() - started < 10


def test_tools_test_names_the_skipped_tests_and_why():
    assert re.search(r"pytest -q -rs ", (ROOT / "tools" / "test").read_text())


# ----- 2. the demo shows its progress -------------------------------------------------------

def test_a_demo_step_over_a_second_shows_a_bar_on_a_terminal(monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import demo
    finally:
        sys.path.remove(str(ROOT / "tools"))
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # rows, cols
    terminal = os.fdopen(slave, "w")
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    read = []
    report = demo.Report()
    started = time.monotonic()
    with report.step("2 snapshot the source", unit="B") as step:
        step.bar.total = 1000
        step.poll = lambda: int(min(1.0, (time.monotonic() - started) / 1.6) * 1000)
        time.sleep(1.8)
    terminal.flush()
    os.set_blocking(master, False)
    while True:
        try:
            read.append(os.read(master, 65536))
        except BlockingIOError:
            break
    shown = b"".join(read).decode(errors="replace")
    assert "2 snapshot the source:" in shown and "%|" in shown and "/1.00k" in shown, shown
    assert [s.name for s in report.steps] == ["2 snapshot the source"] and report.ok
    assert sys.stdout.getvalue().startswith("OK ") and "2 snapshot the source" in \
        sys.stdout.getvalue()
    terminal.close()
    os.close(master)


# ----- 3. -m pointed at an execution's directory ---------------------------------------------

EXECUTION_COMMANDS = ("promote", "checkpoint", "preview", "reset", "verify", "diff", "status")


def test_every_command_works_from_an_execution_path_on_the_host(d, snap, tmp_path):
    eid = d.create(snap)
    at = ("-m", d.exec_path(eid))
    (d.exec_path(eid) / "new.txt").write_text("new\n")
    assert no_traceback(cli("diff", *at)).stdout == "A new.txt\n"
    status = json.loads(no_traceback(cli("status", *at)).stdout)
    assert (status["execution"], status["base"]) == (eid, snap)
    assert no_traceback(cli("preview", *at)).returncode == 0
    assert (no_traceback(cli("verify", *at)).returncode, cli("verify", *at).stdout) == (
        1, "A new.txt\n")
    checkpoint = no_traceback(cli("checkpoint", *at)).stdout.strip()
    promoted = no_traceback(cli("promote", *at, "--label", "here")).stdout.strip()
    assert re.fullmatch("[0-9a-f]{64}", checkpoint) and re.fullmatch("[0-9a-f]{64}", promoted)
    assert json.loads(cli("status", *at).stdout)["head"] == promoted
    assert no_traceback(cli("reset", *at)).returncode == 0
    assert cli("diff", *at, eid).stdout == ""  # the same execution, named too
    other = no_traceback(cli("diff", *at, "someone-else"))
    assert (other.returncode, other.stderr) == (4, (
        f"rametfs: -m names the directory of execution {eid}, not of 'someone-else': leave "
        "EXECUTION out, or give -m the mountpoint\n"))
    # The mount's own commands act on the mount that holds the execution.
    listing = no_traceback(cli("ls", *at))
    assert listing.returncode == 0 and any(line.startswith(eid) for line in
                                            listing.stdout.splitlines())
    made = no_traceback(cli("create", *at, snap[:12]))
    assert made.returncode == 0 and no_traceback(cli("release", *at, made.stdout.strip())
                                                 ).returncode == 0
    assert no_traceback(cli("log", *at, promoted[:12])).stdout.startswith(promoted)
    assert no_traceback(cli("snapshot", *at, tmp_path)).returncode == 0
    # Without .ramet (--control none) the path is still an execution of the mount.
    hidden = d.ctl(f"create {snap} --control none")["execution"]
    assert json.loads(cli("status", "-m", d.exec_path(hidden)).stdout)["control"] == "none"


def sandboxed_cli(d, eid: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI inside a sandbox that sees only execution ``eid``, at /workspace, the mount
    hidden (bubblewrap, as root: the daemon's uid owns the execution)."""
    require_bwrap()
    return run("bwrap", "--bind", "/", "/", "--bind", d.exec_path(eid), "/workspace",
               "--tmpfs", d.mnt, "--chdir", "/workspace", "--", *RAMETFS, *args, check=False)


def test_inside_a_sandbox_the_execution_commands_work_and_the_others_say_what_they_need(
        d, snap, tmp_path):
    eid = d.create(snap)
    (d.exec_path(eid) / "new.txt").write_text("new\n")
    assert sandboxed_cli(d, eid, "diff", "-m", "/workspace").stdout == "A new.txt\n"
    assert json.loads(sandboxed_cli(d, eid, "status", "-m", ".").stdout)["execution"] == eid
    promoted = sandboxed_cli(d, eid, "promote", "-m", "/workspace")
    assert promoted.returncode == 0 and d.exec_status(eid)["head"] == promoted.stdout.strip()
    for args in (("ls",), ("snapshot", "/tmp"), ("create", snap), ("release", eid),
                 ("log", snap), ("restore", snap)):
        proc = no_traceback(sandboxed_cli(d, eid, *args, "-m", "/workspace"))
        what = {"ls": "the mount's status", "log": "the mount's status"}.get(
            args[0], "create" if args[0] == "restore" else args[0])
        assert (proc.returncode, proc.stderr) == (4, (
            f"rametfs: /workspace is execution {eid}'s directory, not a rametfs mount: {what} "
            "needs the mountpoint (the harness's, outside any sandbox); this execution's own "
            "commands work here\n")), args


def test_no_user_error_prints_a_traceback(d, snap, tmp_path):
    for args in (("ls", "-m", tmp_path), ("fsck", "--data", tmp_path), ("diff", "-m", d.mnt),
                 ("create", "-m", d.mnt, snap, "--policy", tmp_path),
                 ("umount", tmp_path), ("status", "-m", d.mnt, "../..")):
        proc = cli(*args)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert proc.stderr.startswith(("rametfs: ", "Usage: ")), (args, proc.stderr)


# ----- 4. what the README's commands met --------------------------------------------------

def test_mount_makes_a_missing_mountpoint_and_names_a_file_in_the_way(tmp_path):
    require_fuse()
    mnt = tmp_path / "deep" / "mnt"
    made = cli("mount", "--data", tmp_path / "data", mnt, "--background")
    try:
        assert made.returncode == 0 and os.path.ismount(mnt), made.stderr
    finally:
        assert cli("umount", mnt).returncode == 0
    (tmp_path / "file").write_text("")
    in_the_way = cli("mount", "--data", tmp_path / "data", tmp_path / "file", "--background")
    assert in_the_way.returncode == 2 and f"'{tmp_path / 'file'}' is a file" in \
        in_the_way.stderr, in_the_way.stderr


def test_git_import_of_a_missing_branch_names_the_branches(d, tmp_path):
    repo = tmp_path / "repo"
    write_tree(repo, {"a": "a\n"})
    git = ["git", "-c", "user.name=n", "-c", "user.email=n@example.invalid",
           "-c", "init.defaultBranch=master"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "m"]):
        run(*git, *args, cwd=repo)
    proc = cli("snapshot", "-m", d.mnt, "--git", repo, "--rev", "main")
    assert (proc.returncode, proc.stderr) == (
        3, f"rametfs: {repo}: no commit 'main'; its branches: master\n")
    assert re.fullmatch("[0-9a-f]{64}\n", cli("snapshot", "-m", d.mnt, "--git", repo,
                                              "--rev", "HEAD").stdout)


# ----- 5. ids -------------------------------------------------------------------------------

def test_snapshot_prefixes_are_symlinks_to_the_one_view_of_the_id(d, snap, tmp_path):
    snapshots = d.mnt / protocol.SNAPSHOTS_DIR
    full = snapshots / snap
    for n in (8, 12, 63):
        link = snapshots / snap[:n]
        assert stat.S_ISLNK(os.lstat(link).st_mode) and os.readlink(link) == snap
        assert os.stat(link).st_ino == os.stat(full).st_ino  # the view of the id itself
        assert (link / "a.txt").read_text() == "alpha\n"
    assert os.lstat(snapshots / snap[:8]).st_ino == os.lstat(snapshots / snap[:12]).st_ino
    for name in (snap[:7], snap[:12].upper(), "0" * 12, snap[:12] + "g"):
        with pytest.raises(FileNotFoundError):
            os.lstat(snapshots / name)
    assert sorted(os.listdir(snapshots)) == sorted(s["id"] for s in d.status()["snapshots"])


def test_snapshot_names_are_symlinks_that_follow_the_name(d, snap, tmp_path):
    """``snapshots/<name>`` is a symlink to the id the name gives now: moved, the same path
    leads to the new snapshot (entry timeout 0); deleted, it is ENOENT."""
    snapshots = d.mnt / protocol.SNAPSHOTS_DIR
    other = d.snapshot(write_tree(tmp_path / "other", {"a.txt": "other\n"}))
    d.ctl(f"name stable {snap}")
    assert os.readlink(snapshots / "stable") == snap
    assert (snapshots / "stable" / "a.txt").read_text() == "alpha\n"
    assert os.stat(snapshots / "stable").st_ino == os.stat(snapshots / snap).st_ino
    d.ctl(f"name stable {other}")
    assert os.readlink(snapshots / "stable") == other
    assert (snapshots / "stable" / "a.txt").read_text() == "other\n"
    d.ctl("unname stable")
    with pytest.raises(FileNotFoundError):
        os.lstat(snapshots / "stable")
    assert "stable" not in os.listdir(snapshots)  # names are found by lookup, never listed


def test_the_cli_takes_the_ids_it_prints_and_says_the_minimum(d, snap):
    shown = next(line.split()[0] for line in cli("ls", "-m", d.mnt).stdout.splitlines()
                 if line.strip() and snap.startswith(line.split()[0]))
    assert len(shown) == 12
    assert cli("create", "-m", d.mnt, shown).returncode == 0
    short = cli("create", "-m", d.mnt, snap[:4])
    assert (short.returncode, short.stderr) == (
        3, f"rametfs: no snapshot {snap[:4]!r}: give at least 8 hex digits\n")
    assert "unique prefix of at least 8 hex digits" in " ".join(
        cli("create", "--help").stdout.split())


# ----- 6. errors from control files ---------------------------------------------------------

def test_commands_on_the_wrong_ctl_say_where_they_belong(d, snap):
    eid = d.create(snap)
    own = d.exec_path(eid) / protocol.CONTROL_DIR
    for line, message in [
            ("snapshot /tmp", "snapshot /tmp: snapshot: a command of the root .ramet/ctl, at the "
             "top of the mount (the harness's), not of an execution's; this one takes "
             "checkpoint, preview, promote, reset, verify\n"),
            ("status", "status: status: read this execution's .ramet/status instead\n")]:
        with pytest.raises(OSError) as caught:
            ctl_command(own / protocol.CTL, line)
        assert caught.value.errno == errno.EINVAL
        assert (own / protocol.ERROR).read_text() == message
    with pytest.raises(OSError) as caught:
        d.ctl("promote --label x")
    assert caught.value.reply["error"] == (
        "promote: expected <execution>, got 0 argument(s): on the root ctl, promote names its "
        "execution first (promote <execution-id> ...); an execution's own .ramet/ctl takes "
        "promote alone")


def test_garbage_written_to_ctl_is_shown_escaped_and_cut(d, snap):
    eid = d.create(snap)
    own = d.exec_path(eid) / protocol.CONTROL_DIR
    fd = os.open(own / protocol.CTL, os.O_WRONLY)
    try:
        with pytest.raises(OSError) as caught:
            os.write(fd, b"promote\x1b]0;owned\x07\xff " + b"x" * 5000)  # one write, one command
    finally:
        os.close(fd)
    assert caught.value.errno == errno.EINVAL
    error = (own / protocol.ERROR).read_text()
    assert error.startswith(r"promote\x1b]0;owned\x07\ufffd xxx") and "... (5019 characters):" \
        in error and error.endswith(": a command is UTF-8 text\n")
    assert not set(error[:-1]) & {"\x1b", "\x07", "\ufffd", "\n"} and len(error) < 400


def test_snapshot_of_a_relative_path_or_of_an_execution_says_what_to_give(d, snap):
    eid = d.create(snap)
    for line, message in [
            ("snapshot project", "snapshot: path 'project' is not absolute: the daemon has no "
             "working directory of yours; give it from /, as in snapshot \"$PWD/project\" (the "
             "CLI and the wrapper do)"),
            (f"snapshot {d.exec_path(eid)}/sub", f"snapshot: {d.exec_path(eid)}/sub is in "
             f"execution {eid} of this mount: promote {eid} (its new head) or checkpoint {eid} "
             "(its base stays) snapshots it, storing only what changed"),
            (f"snapshot {d.snap_path(snap)}", f"snapshot: {d.snap_path(snap)} is in this "
             f"rametfs mount, in snapshot {snap}: that is a snapshot already")]:
        with pytest.raises(OSError) as caught:
            d.ctl(line)
        assert (caught.value.errno, caught.value.reply["error"]) == (errno.EINVAL, message)


def test_a_read_only_executions_refusal_is_in_its_error_file(d, snap):
    eid = d.ctl(f"create {snap} --control read")["execution"]
    own = d.exec_path(eid) / protocol.CONTROL_DIR
    refused = run("sh", "-c", "echo promote > .ramet/ctl", cwd=d.exec_path(eid), check=False)
    assert "Permission denied" in refused.stderr
    why = "this execution's control files are read-only (--control read); the harness acts " \
          "on it through the root ctl\n"
    assert (own / protocol.ERROR).read_text() == "a write to .ramet/ctl: " + why
    run("sh", "-c", "echo promote >> .ramet/ctl", cwd=d.exec_path(eid), check=False)
    assert (own / protocol.ERROR).read_text() == "promote: " + why
    assert d.exec_status(eid)["last"]["errno"] == errno.EACCES
    # The harness still promotes it, through the root ctl (the CLI's way for the harness).
    assert cli("promote", "-m", d.exec_path(eid)).returncode == 0


def test_a_busy_umount_names_the_processes_and_lazy(tmp_path):
    require_fuse()
    with serving(tmp_path) as d:
        snap = d.snapshot(write_tree(tmp_path / "src", {"f": "f\n"}))
        eid = d.create(snap)
        holder = subprocess.Popen(["sleep", "60"], cwd=d.exec_path(eid))
        reader = subprocess.Popen(["sh", "-c", "exec 3<f; exec sleep 60"], cwd=d.exec_path(eid))
        try:
            wait_until(lambda: os.path.exists(f"/proc/{reader.pid}/fd/3"), 10, "the reader")
            busy = cli("umount", d.mnt)
            assert busy.returncode == 5, busy.stderr
            assert f"pid {holder.pid} (sleep): working directory" in busy.stderr
            assert f"pid {reader.pid} (sleep): open file {d.exec_path(eid) / 'f'}" in busy.stderr
            assert f"rametfs umount --lazy {d.mnt} detaches it now" in busy.stderr
            assert d.is_alive()
            started = time.monotonic()
            lazy = cli("umount", "--lazy", d.mnt)
            assert (lazy.returncode, lazy.stderr) == (0, f"detached {d.mnt}; its daemon (pid "
                                                         f"{d.pid}) exits once the last "
                                                         f"process using it lets go\n")
            assert time.monotonic() - started < 5 and not os.path.ismount(d.mnt)
            assert pid_alive(d.pid)  # the holders still use it
        finally:
            for proc in (holder, reader):
                proc.kill()
                proc.wait()
        wait_until(lambda: not pid_alive(d.pid), 30, "the daemon to exit once let go")
        d.pid = None  # stopped


# ----- 7. protocol page, exit codes, mount and umount --------------------------------------

def test_the_protocol_page_names_every_file_command_and_errno():
    page = (ROOT / "docs" / "protocol.md").read_text()
    for name in (*protocol.ROOT_COMMANDS, *protocol.EXECUTION_COMMANDS):
        assert re.search(rf"`{re.escape(name)}[ `]", page), name
    for name in {*protocol.ROOT_CONTROL_FILES, *protocol.EXECUTION_CONTROL_FILES}:
        assert f".ramet/{name}`" in page, name
    for err, code in EXIT_CODES.items():
        assert re.search(rf"^\| {errno.errorcode[err]} \| {code} \|", page, re.M), err
    for err in ("EIO", "EDQUOT", "EAGAIN", "ECANCELED", "EFBIG", "E2BIG", "EROFS"):
        assert re.search(rf"^\| {err} \| 1 \|", page, re.M), err


def test_help_gives_every_exit_code():
    text = cli("--help").stdout
    for err, code in EXIT_CODES.items():
        assert re.search(rf"^\s+{code}\s+{errno.errorcode[err]}\s", text, re.M), err
    assert re.search(r"^\s+2\s+usage", text, re.M) and re.search(r"^\s+1\s+failed", text, re.M)


def test_serve_is_mount_and_umount_takes_ramet_mount(tmp_path):
    require_fuse()
    served = cli("serve", "--data", tmp_path / "data", tmp_path / "mnt", "--background")
    try:
        assert served.returncode == 0, served.stderr
        assert cli("ls", env={"RAMET_MOUNT": str(tmp_path / "mnt")}).returncode == 0
        gone = cli("umount", env={"RAMET_MOUNT": str(tmp_path / "mnt")})
        assert gone.returncode == 0 and not os.path.ismount(tmp_path / "mnt"), gone.stderr
    finally:
        if os.path.ismount(tmp_path / "mnt"):
            cli("umount", tmp_path / "mnt")
    usage = cli("umount", env={"RAMET_MOUNT": None})
    assert usage.returncode == 2 and "$RAMET_MOUNT" in usage.stderr


def test_a_failed_second_mount_writes_nothing_into_the_live_daemons_log(tmp_path):
    require_fuse()
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    assert cli("mount", "--data", data, mnt, "--background").returncode == 0
    try:
        log = data / "daemon.log"  # the default log of both
        before = log.read_bytes()
        for args, why in [(("--data", data, tmp_path / "other"), "is in use by the rametfs "
                           f"daemon pid {json.loads((mnt / '.ramet' / 'status').read_text())['pid']}"
                           f", serving {mnt}: rametfs umount {mnt} stops it"),
                          (("--data", tmp_path / "data2", mnt), "is already a mountpoint")]:
            second = cli("mount", *args, "--background")
            assert second.returncode == 5 and why in second.stderr, second.stderr
            assert log.read_bytes() == before
        assert not (tmp_path / "data2").exists()
    finally:
        assert cli("umount", mnt).returncode == 0


# ----- 8. the daemon kept alive by a copy of its mount in another namespace -------------------

@pytest.mark.parametrize("copied", ["the mount", "an execution"])
def test_umount_names_copies_in_other_namespaces_and_force_ends_them(tmp_path, copied):
    # A copy of the whole mount (unshare -m) keeps its path; a sandbox's bind of an execution
    # has another mountpoint and root, so once the mount here is gone only the daemon's lock
    # says which connection was the mount's.
    require_fuse()
    data, mnt = tmp_path / "data", tmp_path / "mnt"
    d = Daemon(data, mnt)
    d.start()
    snap = d.snapshot(write_tree(tmp_path / "src", {"kept": "kept\n"}))
    pid = d.pid
    made = "echo ready && exec sleep 60"
    if copied == "an execution":
        work = tmp_path / "work"
        work.mkdir()
        made = f'mount --bind "{mnt / "executions" / d.create(snap)}" "{work}" && ' \
               f'umount -l "{mnt}" && {made}'
    copy = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", made],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert copy.stdout.readline() == "ready\n"
        left = cli("umount", mnt)
        assert left.returncode == 5 and not os.path.ismount(mnt), left.stderr
        assert f"its daemon (pid {pid}) goes on serving copies" in left.stderr
        assert f"the mount namespace of pid {copy.pid} (sleep)" in left.stderr
        assert f"rametfs umount --force {mnt}" in left.stderr
        again = cli("mount", "--data", data, mnt, "--background")
        assert again.returncode == 5 and (
            f"{data} is in use by the rametfs daemon pid {pid}, which served {mnt}: that is no "
            "longer mounted here") in again.stderr and f"rametfs umount --force {mnt}" in \
            again.stderr, again.stderr
        forced = cli("umount", "--force", mnt)
        assert forced.returncode == 0, forced.stderr
        assert not pid_alive(pid)
        assert "unmounted" in d.log_text().splitlines()[-1]
    finally:
        copy.kill()
        copy.wait()
        copy.stdout.close()
        d.pid = None
    assert cli("umount", "--force", mnt).returncode == 7  # nothing of it is left anywhere
    d.start()  # the data directory is free, and what it held is there
    try:
        assert (d.snap_path(snap) / "kept").read_text() == "kept\n"
    finally:
        d.stop()


def test_only_a_lock_held_by_the_callers_uid_or_root_names_a_mounts_connection(tmp_path):
    # Another user's process holding a file named daemon.lock that claims the mountpoint must
    # not point umount --force at a connection of its choosing.
    require_fuse()
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another uid")
    d = Daemon(tmp_path / "data", tmp_path / "mnt")
    d.start()
    try:
        assert served_by(str(d.mnt)) == (d.pid, mount_at(str(d.mnt)).dev)
    finally:
        d.stop()
    fd = os.open(tmp_path / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    liar = subprocess.Popen(  # writes its claim through the descriptor it inherits
        ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", sys.executable,
         "-c", f"import os, time; os.write({fd}, f'{{os.getpid()}}\\n{d.mnt}\\n0:1\\n'.encode()); "
               "print(1, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, pass_fds=(fd,))
    os.close(fd)
    try:
        assert liar.stdout.readline() == "1\n"
        assert served_by(str(d.mnt)) is None
    finally:
        liar.kill()
        liar.wait()
        liar.stdout.close()


def test_copies_are_found_while_processes_of_other_namespaces_exit():
    # Between the namespace's readlink and the read of its mountinfo a process may exit: a
    # zombie's mountinfo is EINVAL (it failed rametfs umount once in the suite, and about 1
    # call in 40 with four threads running "unshare -m true" in a loop).
    stop: list[bool] = []

    def churn() -> None:
        while not stop:
            subprocess.run(["unshare", "--mount", "true"], check=True)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        deadline, calls = time.monotonic() + 2, 0
        while time.monotonic() < deadline:
            assert copies_elsewhere(point="/nonexistent/rametfs") == []
            calls += 1
    finally:
        stop.append(True)
        for thread in threads:
            thread.join()
    assert calls > 100


# ----- fsck, and the CLI's small edges ------------------------------------------------------

def test_fsck_reads_only_and_refuses_a_directory_without_a_store(d, snap, tmp_path):
    plain = write_tree(tmp_path / "proj", {"f": "f\n"})
    os.chmod(plain, 0o755)
    refused = cli("fsck", "--data", plain)
    assert (refused.returncode, refused.stdout, refused.stderr) == (3, "", (
        f"rametfs: fsck: {plain} holds no rametfs store (no meta/data.mdb): give the --data "
        "directory a daemon was served with\n"))
    assert sorted(os.listdir(plain)) == ["f"] and stat.S_IMODE(os.stat(plain).st_mode) == 0o755
    assert cli("fsck", "--data", plain / "f").returncode == 4
    assert cli("fsck", "--data", tmp_path / "missing").returncode == 3
    entries = sorted(os.listdir(d.data_dir))
    checked = cli("fsck", "--data", d.data_dir)  # beside the live daemon
    assert checked.returncode == 0 and "; 0 problems" in checked.stderr, checked.stderr
    assert sorted(os.listdir(d.data_dir)) == entries


def test_create_names_empty_and_taken_and_ls_shows_access_and_quotas(d, snap):
    empty = cli("create", "-m", d.mnt, snap, "--name", "")
    assert (empty.returncode, empty.stdout) == (4, "") and "--name ''" in empty.stderr
    with pytest.raises(OSError) as caught:
        d.ctl(f"create {snap} --name ''")
    assert caught.value.errno == errno.EINVAL
    assert cli("create", "-m", d.mnt, snap, "--name", "taken").returncode == 0
    taken = cli("create", "-m", d.mnt, snap, "--name", "taken")
    assert (taken.returncode, taken.stderr) == (8, "rametfs: execution 'taken' already exists\n")
    assert cli("create", "-m", d.mnt, snap, "--name", "boxed", "--owner", str(NOBODY),
               "--group", "100", "--share", "0750", "--control", "read", "--max-bytes",
               "1G").returncode == 0  # truncate's sizes: 1G is 1 << 30 bytes
    limits = {e["id"]: e["max_bytes"] for e in d.status()["executions"]}
    assert limits["boxed"] == 1 << 30
    for size, kilo in (("1.5M", 1024), ("3KB", 1000)):
        assert cli("create", "-m", d.mnt, snap, "--name", f"sized-{kilo}",
                   "--max-bytes", size).returncode == 0
    limits = {e["id"]: e["max_bytes"] for e in d.status()["executions"]}
    assert (limits["sized-1024"], limits["sized-1000"]) == (1536 * 1024, 3000)
    bad = cli("create", "-m", d.mnt, snap, "--max-bytes", "1.5X")
    assert bad.returncode == 2 and ("'1.5X' is not a size such as 1073741824, 512M or 1.5G"
                                    in bad.stderr), bad.stderr
    rows = {line.split()[0]: line.split() for line in cli("ls", "-m", d.mnt).stdout.splitlines()
            if line.strip()}
    assert rows["EXECUTION"][5:7] == ["ACCESS", "QUOTA"]
    assert rows["boxed"][5:7] == [f"{NOBODY}:100/0750/read", "1.0G/-"]
    assert rows["taken"][5:7] == [f"{os.getuid()}:{os.getgid()}/0700/full", "-/-"]


def test_release_of_a_leased_execution_says_what_to_do_from_the_cli(d, snap):
    pool = d.ctl(f"pool {snap} --size 1 --name newcomers")
    leased = d.ctl("acquire newcomers --holder me --ttl 60 --pid 1 --host h")["execution"]
    refused = cli("release", "-m", d.mnt, leased)
    assert refused.returncode == 5
    assert refused.stderr.startswith(f"rametfs: execution {leased!r} is leased by me (pid 1 on "
                                     "h), whose ExecutionPool.acquire() block gives it back "
                                     "when it ends; else the lease expires in ")
    assert "return" not in refused.stderr.replace("returns it", "")
    d.ctl("drop newcomers")
    assert pool["executions"] == [leased]


def test_a_lease_shows_only_the_pid_and_host_it_gave(d, snap):
    """A lease acquired by a control command gives no --pid or --host: ls shows its holder
    alone, not ``me (pid 0@)``."""
    d.ctl(f"pool {snap} --size 2 --name bare")
    bare = d.ctl("acquire bare --holder me --ttl 60")["execution"]
    with_pid = d.ctl("acquire bare --holder you --ttl 60 --pid 7")["execution"]
    rows = {line.split()[0]: line.split() for line in cli("ls", "-m", d.mnt).stdout.splitlines()
            if line.strip()}
    assert rows[bare][-5:-1] == ["leased", "bare", "me", "in"], rows[bare]
    assert rows[with_pid][-7:-1] == ["leased", "bare", "you", "(pid", "7)", "in"], rows[with_pid]
    d.ctl("drop bare")


def test_another_uid_is_told_permission_denied_not_not_mounted(d, snap):
    """The user's own sandbox as uid 65534 on an execution the harness owns: EACCES saying
    who decides, not "no rametfs mounted" (which sent a newcomer looking for a mount)."""
    eid = d.create(snap)
    proc = no_traceback(run("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                            "--clear-groups", *RAMETFS, "diff", "-m", d.exec_path(eid),
                            check=False))
    assert (proc.returncode, proc.stderr) == (9, (  # EACCES's exit code (rametfs --help)
        f"rametfs: {d.exec_path(eid) / '.ramet' / 'status'}: permission denied: uid {NOBODY} "
        "may not use this execution (its owner, create --owner, and --share decide)\n"))
