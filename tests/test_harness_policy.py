"""The policy comes from the harness, recipes run sandboxed, output cannot be forged.

Issue 16, points 3 and 6, each as a test (docs/security.md, "Policies, recipes and output"):
an agent's own ``ramet.toml`` applies only when the harness names it (``--policy tree``); a
policy stored at create or on a pool applies to promote and preview, survives reset and
restart, and the agent cannot change it; a restore runs recipes in the sandbox the execution
was used with (bubblewrap here, for real, as uid 65534), and refuses when none is recorded
and none is named; names are quoted as ``git status --porcelain`` quotes them and parsed
back exactly; labels and messages are length-limited and printed with control characters
escaped.  Most tests run in both modes (the ``ramet`` fixture); the bubblewrap ones on a
daemon of this module served with ``--allow-other``.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import cli_where, ctl_command, require_bwrap
from rametfs import Ramet, RametError, protocol, restore
from rametfs.cli import main
from rametfs.client import RestoreError
from rametfs.protocol import quote_path
from rametfs.sandbox import Bubblewrap, Docker

NOBODY = 65534
# What a hostile agent writes into its tree (issue 16): drop the harness's results from its
# promote, and a recipe that a restore would run as root on the host.
AGENT_POLICY = """\
ephemeral = ["important_results/"]

[rebuildable.x]
paths = ["out/"]
command = "id > ../PWNED"
"""
HARNESS_POLICY = 'ephemeral = ["*.log"]\n'
WHO_RECIPE = '[rebuildable.who]\npaths = ["who/"]\ncommand = "mkdir -p who && id -u > who/uid"\n'
NO_SANDBOX = ("records no sandbox to run its recipes in (no sandbox adapter ran the execution "
              "it was promoted from): give a runtime, one of bubblewrap, docker or host (host "
              "runs them unsandboxed, as this user)")


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def files_of(ramet: Ramet, sid: str) -> set[str]:
    """The paths of snapshot ``sid`` but its directories, read from a fresh execution."""
    ex = ramet.create(sid)
    try:
        return {str(p.relative_to(ex.path)) for p in ex.path.rglob("*")
                if p.is_symlink() or not p.is_dir()}
    finally:
        ramet.release(ex)


def record_of(ramet: Ramet, sid: str) -> dict:
    return next(s for s in ramet.snapshots() if s["id"] == sid)


def cli(*args: str) -> subprocess.CompletedProcess:
    result = CliRunner().invoke(main, list(args))
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout_bytes,
                                       result.stderr_bytes)


@pytest.fixture
def base(ramet, tmp_path) -> str:
    src = tmp_path / "src"
    write(src, {"main.py": "print(1)\n", "data/table.csv": "x\n"})
    return ramet.snapshot(src)


# ----- 3. the policy comes from the harness ----------------------------------------------------

def test_the_trees_policy_applies_only_when_the_harness_names_it(ramet, base):
    ex = ramet.create(base)
    write(ex.path, {"ramet.toml": AGENT_POLICY, "important_results/r.csv": "42\n",
                    "out/o": "o\n"})
    everything = {"main.py", "data/table.csv", "ramet.toml", "important_results/r.csv", "out/o"}
    sid = ex.promote()  # the harness's promote: the agent's ramet.toml is just a file
    assert files_of(ramet, sid) == everything
    assert (record_of(ramet, sid)["recipes"], "policy" in record_of(ramet, sid)) == ([], False)
    report = ex.preview()
    assert (report["policy"], {p["class"] for p in report["paths"]}) == (None, {"durable"})
    if ramet.mode == "fuse":  # what the agent reads inside: the harness's (no) policy
        assert json.loads((ex.path / ".ramet" / "preview").read_text())["policy"] is None

    # neither a symlink nor a malformed ramet.toml blocks the harness's promote ...
    (ex.path / "ramet.toml").unlink()
    os.symlink("/etc/passwd", ex.path / "ramet.toml")
    assert files_of(ramet, ex.promote()) == everything
    with pytest.raises(RametError) as info:  # ... but they do when the harness trusts it
        ex.promote(policy="tree")
    assert (info.value.errno, str(info.value)) == (errno.EINVAL,
                                                   "ramet.toml is not a regular file")
    (ex.path / "ramet.toml").unlink()
    (ex.path / "ramet.toml").write_text("ephemeral = [\n")
    assert files_of(ramet, ex.promote()) == everything
    with pytest.raises(RametError) as info:
        ex.promote(policy="tree")
    assert (info.value.errno, str(info.value)) == (errno.EINVAL,
                                                   "ramet.toml, line 2: Invalid value")

    (ex.path / "ramet.toml").unlink()
    os.mkfifo(ex.path / "ramet.toml")  # never waited on
    with pytest.raises(RametError) as info:
        ex.promote(policy="tree")
    assert str(info.value) == "ramet.toml is not a regular file"
    (ex.path / "ramet.toml").unlink()
    (ex.path / "ramet.toml").write_text("#" * (64 * 1024 + 1))  # never read whole
    with pytest.raises(RametError) as info:
        ex.preview(policy="tree")
    assert (info.value.errno, str(info.value)) == (
        errno.EINVAL, "ramet.toml is 65537 bytes: a policy is at most 65536")

    (ex.path / "ramet.toml").write_text(AGENT_POLICY)
    trusted = ex.promote(policy="tree")  # only now does the tree's policy apply
    assert files_of(ramet, trusted) == {"main.py", "data/table.csv", "ramet.toml"}
    rec = record_of(ramet, trusted)
    assert (rec["policy"], [r["command"] for r in rec["recipes"]]) == (
        "ramet.toml", [["sh", "-c", "id > ../PWNED"]])
    ramet.release(ex)


def test_a_policy_stored_at_create_applies_and_the_agent_cannot_change_it(ramet, base,
                                                                          tmp_path):
    harness = tmp_path / "harness.toml"
    harness.write_text(HARNESS_POLICY)
    ex = ramet.create(base, policy=harness)
    assert ex.status()["policy"] == "create --policy"
    # the agent's own policy would keep its logs and drop the data
    write(ex.path, {"ramet.toml": 'durable = ["*.log"]\nephemeral = ["data/"]\n',
                    "run.log": "noise\n"})
    classes = {p["path"]: p["class"] for p in ex.preview()["paths"]}
    assert classes == {"data/table.csv": "durable", "main.py": "durable",
                       "ramet.toml": "durable", "run.log": "ephemeral"}
    if ramet.mode == "fuse":
        shown = json.loads((ex.path / ".ramet" / "preview").read_text())
        assert (shown["policy"], {p["path"]: p["class"] for p in shown["paths"]}) == (
            "create --policy", classes)
        # the agent cannot give a policy of its own, not even for a preview
        for line in ("preview --policy none", "promote --policy none", "checkpoint --policy tree"):
            with pytest.raises(OSError) as caught:
                ctl_command(ex.path / ".ramet" / "ctl", line)
            assert caught.value.errno == errno.EACCES
            assert caught.value.reply["error"].endswith(
                "the policy is the harness's (create --policy, or the root ctl); an execution "
                "cannot give its own")
    kept = {"main.py", "data/table.csv", "ramet.toml"}
    sid = ex.promote()
    assert (files_of(ramet, sid), record_of(ramet, sid)["policy"]) == (kept, "create --policy")
    ex.reset(base=True)  # back to the base, without the agent's ramet.toml; the policy stays
    write(ex.path, {"run.log": "again\n"})
    assert files_of(ramet, ex.promote()) == {"main.py", "data/table.csv"}
    # a --policy given at promote overrides it for that promote only
    assert files_of(ramet, ex.promote(policy="none")) == {"main.py", "data/table.csv",
                                                          "run.log"}
    assert files_of(ramet, ex.promote()) == {"main.py", "data/table.csv"}
    ex.checkpoint()
    assert ex.status()["policy"] == "create --policy"
    ramet.release(ex)

    with pytest.raises(RametError) as info:  # refused when given, not at the first promote
        ramet.create(base, name="bad-policy", policy=tmp_path / "missing.toml")
    assert info.value.errno == errno.ENOENT
    (tmp_path / "bad.toml").write_text('ephemeral = "*.log"\n')
    before = {e["id"] for e in ramet.executions()}
    with pytest.raises(RametError) as info:
        ramet.create(base, name="bad-policy", policy=tmp_path / "bad.toml")
    assert (info.value.errno, str(info.value)) == (
        errno.EINVAL, "create --policy, line 1: ephemeral: expected a list of glob strings")
    assert {e["id"] for e in ramet.executions()} == before
    trusting = ramet.create(base, policy="tree")
    assert trusting.status()["policy"] == "ramet.toml"
    ramet.release(trusting)


@pytest.mark.allow_log(r"WARNING rametfs\.control\.commands: execution harness-policy-fuse-\w+ "
                       r"quarantined: root verification")
def test_pool_members_are_created_with_the_pools_policy(ramet, base, tmp_path):
    harness, other = tmp_path / "harness.toml", tmp_path / "other.toml"
    harness.write_text(HARNESS_POLICY)
    other.write_text('ephemeral = ["data/"]\n')
    name = f"harness-policy-{ramet.mode}"
    pool = ramet.execution_pool(base, 2, name=name, policy=harness)
    try:
        for _ in range(2):  # the second time: the same member, reset and returned
            with pool.acquire() as ex:
                write(ex.path, {"run.log": "noise\n", "result.txt": "1\n"})
                assert files_of(ramet, ex.promote()) == {"main.py", "data/table.csv",
                                                         "result.txt"}
        members = [e["policy"] for e in ramet.executions() if e["pool"] == name]
        assert members == ["pool --policy"] * 2
        with pytest.raises(RametError) as info:
            ramet.execution_pool(base, 2, name=name, policy=other)
        assert (info.value.errno, str(info.value)) == (
            errno.EEXIST, f"pool {name!r} exists with another persistence policy")
        ramet.execution_pool(base, 3, name=name).close()  # reattached: the pool's policy
        assert [e["policy"] for e in ramet.executions() if e["pool"] == name] == \
            ["pool --policy"] * 3
        with pytest.raises(RametError) as info:
            ramet.execution_pool(base, 1, policy=tmp_path / "none-such")
        assert info.value.errno == errno.ENOENT
        ready = next(e["id"] for e in ramet.executions()
                     if e["pool"] == name and e["state"] == "ready")
        (ramet.execution(ready).path / "x\nM a.txt").write_text("planted\n")
        ramet.execution(ready).verify()
        reason = ramet.execution(ready).status()["quarantine_reason"]  # fallback: "M /" too
        assert reason.startswith("root verification: differs from its base (")
        assert reason.endswith('A "x\\nM a.txt")') and "\n" not in reason
    finally:
        pool.drop()


def test_stored_policy_and_runtime_survive_a_daemon_restart(daemon, tmp_path):
    src = tmp_path / "src"
    write(src, {"main.py": "print(1)\n"})
    sid = daemon.snapshot(src)
    eid = daemon.ctl(protocol.format_command("create", sid, policy=HARNESS_POLICY))["execution"]
    daemon.ctl(f"runtime {eid} bubblewrap --uid 1000 --gid 1000")
    daemon.restart()
    path = daemon.exec_path(eid)
    write(path, {"run.log": "noise\n", "keep.txt": "k\n"})
    shown = json.loads((path / ".ramet" / "preview").read_text())
    assert (shown["policy"], [(p["path"], p["class"]) for p in shown["paths"]]) == (
        "create --policy", [("keep.txt", "durable"), ("main.py", "durable"),
                            ("run.log", "ephemeral")])
    [status] = [e for e in daemon.status()["executions"] if e["id"] == eid]  # the harness's
    assert (status["policy"], status["runtime"]) == (
        "create --policy", {"name": "bubblewrap", "uid": 1000, "gid": 1000})
    ramet = Ramet(daemon.mnt)
    assert files_of(ramet, ramet.execution(eid).promote()) == {"keep.txt", "main.py"}
    ramet.release(eid)


def test_fallback_stores_the_policy_in_its_execution_record(tmp_path):
    src = tmp_path / "src"
    write(src, {"main.py": "print(1)\n"})
    harness = tmp_path / "harness.toml"
    harness.write_text(HARNESS_POLICY)
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:
        ex = ramet.create(ramet.snapshot(src), policy=harness)
        ex.record_runtime("docker", 1000, 1000, "python:3.12-slim")
    write(ex.path, {"run.log": "noise\n"})
    with Ramet(data=tmp_path / "data", mode="fallback") as ramet:  # another process, later
        ex = ramet.execution(ex.id)
        assert (ex.status()["policy"], ex.status()["runtime"]) == (
            "create --policy", {"name": "docker", "uid": 1000, "gid": 1000,
                                "image": "python:3.12-slim"})
        assert files_of(ramet, ex.promote()) == {"main.py"}


# ----- 3. recipes run in a sandbox ------------------------------------------------------------

def test_restore_without_a_recorded_sandbox_refuses(ramet, base):
    ex = ramet.create(base, policy="tree")
    write(ex.path, {"ramet.toml": WHO_RECIPE, "who/uid": "stale\n"})
    sid = ex.promote()
    assert record_of(ramet, sid)["runtime"] is None
    before = {e["id"] for e in ramet.executions()}
    with pytest.raises(RametError) as info:
        ramet.restore(sid)
    assert (info.value.errno, str(info.value)) == (errno.EINVAL,
                                                   f"snapshot {sid[:12]} {NO_SANDBOX}")
    assert {e["id"] for e in ramet.executions()} == before  # nothing left behind
    done = cli("restore", *cli_where(ramet), sid)
    assert (done.returncode, done.stdout, done.stderr) == (
        4, b"", f"rametfs: snapshot {sid[:12]} {NO_SANDBOX}\n".encode())
    assert {e["id"] for e in ramet.executions()} == before
    with pytest.raises(RametError) as info:
        ramet.restore(sid, runtime="chroot")
    assert (info.value.errno, str(info.value)) == (
        errno.EINVAL, "unknown runtime 'chroot': expected one of bubblewrap, docker, host")
    with pytest.raises(RametError) as info:
        ramet.restore(sid, runtime="docker")
    assert str(info.value) == (f"snapshot {sid[:12]} records no docker image to run its "
                               "recipes in: give one (rametfs restore --image, or a "
                               "rametfs.sandbox.Docker runtime)")
    restored = ramet.restore(sid, runtime="host")  # asked for: runs as this user
    assert (restored.execution.path / "who" / "uid").read_text() == f"{os.getuid()}\n"
    ramet.release(restored.execution)
    plain = ramet.restore(base)  # no recipes: nothing to run, nothing to refuse
    assert plain.steps == []
    for execution in (plain.execution, ex):
        ramet.release(execution)


def test_runtime_records_are_the_harnesss_and_checked(ramet, base):
    ex = ramet.create(base)
    for args, message in [
        (("sandbox-x", 1, 1), "runtime: the sandbox is one of bubblewrap, docker, not "
                              "'sandbox-x'"),
        (("bubblewrap", 0, 0), "runtime: bubblewrap never runs as root: --uid 0"),
        (("bubblewrap", 1000, 2**32 - 1), "runtime: --gid must be below 4294967295, not "
                                          "4294967295"),
        (("docker", 1000, 1000), "runtime: --image is needed for docker, and only for docker"),
        (("bubblewrap", 1000, 1000, "debian"),
         "runtime: --image is needed for docker, and only for docker"),
        (("docker", 1000, 1000, "--privileged"),
         "runtime: image '--privileged' must match " + protocol.IMAGE_RE.pattern),
    ]:
        with pytest.raises(RametError) as info:
            ex.record_runtime(*args)
        assert (info.value.errno, str(info.value)) == (errno.EINVAL, message)
    assert ex.status()["runtime"] is None
    with pytest.raises(RametError) as info:
        ramet.execution("no-such-execution").record_runtime("bubblewrap", 1000, 1000)
    assert info.value.errno == errno.ENOENT
    if ramet.mode == "fuse":  # the agent's own ctl has no such command
        with pytest.raises(OSError) as info:
            ctl_command(ex.path / ".ramet" / "ctl", f"runtime {ex.id} docker --uid 0 --gid 0 "
                                                    "--image x")
        assert (info.value.errno, info.value.reply["error"]) == (
            errno.EINVAL, "runtime: a command of the root .ramet/ctl, at the top of the mount "
                          "(the harness's), not of an execution's; this one takes checkpoint, "
                          "preview, promote, reset, verify")

    ex.record_runtime("docker", 1000, 1001, "python:3.12-slim")
    write(ex.path, {"ramet.toml": WHO_RECIPE, "who/uid": "1\n"})
    rec = record_of(ramet, ex.promote(policy="tree"))
    assert rec["runtime"] == {"name": "docker", "uid": 1000, "gid": 1001,
                              "image": "python:3.12-slim"}
    run = restore.runtime_for(None, rec["runtime"], rec["id"])  # docker is not installed here
    assert isinstance(run.__self__, Docker)
    assert (run.__self__.image, run.__self__.uid, run.__self__.gid) == (
        "python:3.12-slim", 1000, 1001)
    assert record_of(ramet, ex.promote())["runtime"] is None  # no recipes: nothing to run
    ramet.release(ex)


@pytest.fixture(scope="module")
def sandboxed(allow_other_daemon, tmp_path_factory):
    """``(ramet, base)``: the module's ``--allow-other`` daemon and a snapshot whose tree
    the sandbox's uid 65534 owns."""
    require_bwrap()
    src = tmp_path_factory.mktemp("sandboxed-src")
    write(src, {"main.py": "print(1)\n"})
    for path in (src, src / "main.py"):
        os.chown(path, NOBODY, NOBODY)
    ramet = Ramet(allow_other_daemon.mnt)
    return ramet, ramet.snapshot(src)


def test_recipes_run_in_the_sandbox_the_execution_was_used_with(sandboxed):
    ramet, base = sandboxed
    ex = ramet.create(base, policy="tree")
    write(ex.path, {"ramet.toml": WHO_RECIPE})  # the agent's recipe, trusted by the harness
    assert Bubblewrap().run(ex, ["sh", "-c", "mkdir who && id -u > who/uid"], timeout=30).ok
    assert ex.status()["runtime"] == {"name": "bubblewrap", "uid": NOBODY, "gid": NOBODY}
    sid = ex.promote()
    assert record_of(ramet, sid)["runtime"] == {"name": "bubblewrap", "uid": NOBODY,
                                                "gid": NOBODY}
    assert "who/uid" not in files_of(ramet, sid)
    for runtime in (None, "bubblewrap", Bubblewrap(), Bubblewrap().run):
        restored = ramet.restore(sid, runtime=runtime)
        assert [(s.step, s.ok) for s in restored.steps] == [("inputs", True),
                                                             ("command", True)]
        assert (restored.execution.path / "who" / "uid").read_text() == f"{NOBODY}\n"
        ramet.release(restored.execution)
    done = cli("restore", "-m", str(ramet.mount), sid, "--runtime", "bubblewrap")
    assert done.returncode == 0, done.stderr
    restored = done.stdout.decode().strip()
    assert (ramet.execution(restored).path / "who" / "uid").read_text() == f"{NOBODY}\n"
    for eid in (restored, ex.id):
        ramet.release(eid)


def test_an_agents_recipe_does_not_reach_the_host(sandboxed):
    ramet, base = sandboxed
    ex = ramet.create(base)
    assert Bubblewrap().run(ex, ["sh", "-c", f"printf '%s' '{AGENT_POLICY}' > ramet.toml && "
                                            "mkdir out important_results"], timeout=30).ok
    assert (ex.path / "ramet.toml").read_text() == AGENT_POLICY
    plain = ex.promote()  # the harness names no policy: no recipe is recorded
    assert record_of(ramet, plain)["recipes"] == []
    nothing = ramet.restore(plain)
    assert nothing.steps == []
    ramet.release(nothing.execution)
    trusted = ex.promote(policy="tree")  # the harness trusts the tree: the recipe runs, boxed
    with pytest.raises(RestoreError) as info:
        ramet.restore(trusted)
    assert info.value.errno == errno.EIO
    assert str(info.value).endswith(
        "recipe x: command failed: id > ../PWNED exited 2; output ends with:\n"
        "sh: 1: cannot create ../PWNED: Permission denied")
    assert not (ramet.mount / "executions" / "PWNED").exists()
    for execution in (info.value.execution, ex):
        ramet.release(execution)


# ----- 6. output that cannot be forged ---------------------------------------------------------

NASTY = [b"harmless\nM a.txt", b"tab\there", b'quo"te', b"back\\slash", b"\xff\xfe-not-utf8",
         b" leading space", b"trailing space ", b"a -> b", "caf\u00e9".encode(),
         b"esc\x1b]0;owned\x07", b"del\x7f", b"plain-name"]


def _put(path: bytes, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "-c", "core.quotePath=true", *args],
                          check=True, capture_output=True).stdout


def test_names_are_quoted_as_git_quotes_them_and_parsed_back(ramet, tmp_path):
    src, repo = tmp_path / "src", tmp_path / "repo"
    for top in (src, repo):
        top.mkdir()
        for name in (b"a.txt", b"modified \xff", b"deleted\ttoo"):
            _put(os.fsencode(top) + b"/" + name, b"base\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "b")
    ex = ramet.create(ramet.snapshot(src))
    for top in (os.fsencode(ex.path), os.fsencode(repo)):  # the same changes in both
        for name in NASTY:
            _put(top + b"/" + name, b"x\n")
        _put(top + b"/modified \xff", b"changed\n")
        os.unlink(top + b"/deleted\ttoo")
    changes = sorted([("A", n) for n in NASTY] + [("M", b"modified \xff"),
                                                  ("D", b"deleted\ttoo")],
                     key=lambda change: change[1])
    text = "".join(f"{letter} {quote_path(name)}\n" for letter, name in changes)

    # the forged line of issue 16 is one added name, and every name comes back exactly
    assert ex.diff() == [(letter, os.fsdecode(name)) for letter, name in changes]
    assert ("M", "a.txt") not in ex.diff()
    assert len(text.splitlines()) == len(changes) and text.isascii()
    if ramet.mode == "fuse":
        assert (ex.path / ".ramet" / "diff").read_text() == text
    # each quoted name as git status --porcelain prints it
    letters = {b"??": "A", b" M": "M", b" D": "D"}
    porcelain = _git(repo, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert sorted(f"{letters[line[:2]]} {line[3:].decode()}" for line in porcelain) == \
        sorted(text.splitlines())
    assert [quote_path(n) for n in NASTY[:4]] == [
        '"harmless\\nM a.txt"', '"tab\\there"', '"quo\\"te"', '"back\\\\slash"']

    shown = cli("diff", *cli_where(ramet), ex.id)
    assert (shown.returncode, shown.stdout) == (0, text.encode())
    nul = cli("diff", "-z", *cli_where(ramet), ex.id)
    assert nul.stdout == b"".join(f"{letter} ".encode() + name + b"\0"
                                  for letter, name in changes)
    raw = _git(repo, "status", "--porcelain", "-z", "--untracked-files=all").split(b"\0")[:-1]
    assert sorted(nul.stdout.split(b"\0")[:-1]) == sorted(
        f"{letters[record[:2]]} ".encode() + record[3:] for record in raw)  # git's -z too
    differences = ex.verify()
    verified = cli("verify", *cli_where(ramet), ex.id)
    assert (verified.returncode, verified.stdout.decode()) == (1, "".join(
        f"{letter} {quote_path(os.fsencode(path))}\n" for letter, path in differences))
    assert len(verified.stdout.splitlines()) == len(differences) > 0
    ramet.release(ex)


def test_policy_problems_quote_the_names(ramet, base, tmp_path):
    shared = tmp_path / "shared.toml"
    shared.write_text('shared = ["data/"]\n')
    ex = ramet.create(base, policy=shared)
    (ex.path / "data" / "harmless\nM a.txt").write_text("x")
    problem = 'shared path changed: A "data/harmless\\nM a.txt"'
    assert ex.preview()["problems"] == [problem]
    with pytest.raises(RametError) as info:
        ex.promote()
    assert str(info.value) == f"promote stopped by the policy (create --policy): {problem}"
    ramet.release(ex)


def test_labels_and_messages_are_limited_and_printed_escaped(ramet, base, tmp_path):
    ex = ramet.create(base)
    for kwargs, message in [
        ({"label": "x" * 257}, "promote: --label is at most 256 bytes, not 257"),
        ({"label": "\u00e9" * 129}, "promote: --label is at most 256 bytes, not 258"),
        ({"message": "m" * (16 * 1024 + 1)}, "promote: --message is at most 16384 bytes, "
                                             "not 16385"),
    ]:
        with pytest.raises(RametError) as info:
            ex.promote(**kwargs)
        assert (info.value.errno, str(info.value)) == (errno.EINVAL, message)
    with pytest.raises(RametError) as info:
        ramet.snapshot(tmp_path / "src", label="x" * 257)
    assert str(info.value) == "snapshot: --label is at most 256 bytes, not 257"
    assert ex.promote(label="x" * 256, message="m" * 16 * 1024)  # the limits themselves

    osc = "\x1b]0;owned\x07\x1b[2J"
    sid = ex.promote(label=f"ok{osc}", message=f"line 1\nline 2{osc}\u202e")
    escaped = "\\x1b]0;owned\\x07\\x1b[2J"
    listing = cli("ls", *cli_where(ramet)).stdout.decode()
    assert not {"\x1b", "\x07"} & set(listing)
    row, = [line for line in listing.splitlines() if line.startswith(sid[:12])]
    assert row.split()[3] == f"ok{escaped}"  # SNAPSHOT TREE NAMES LABEL
    log = cli("log", *cli_where(ramet), sid).stdout.decode().splitlines()
    assert log[0].split(" ", 2)[::2] == [sid, f"ok{escaped} line 1\\nline 2{escaped}\\u202e"]
    status = cli("status", *cli_where(ramet)).stdout.decode()
    assert "\x1b" not in status  # JSON escapes it, and keeps the label exactly
    assert record_of(ramet, sid)["label"] == f"ok{osc}"
    ramet.release(ex)
