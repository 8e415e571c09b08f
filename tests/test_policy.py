"""Persistence policies: the parser and classifier, preview, promote with a policy, restore.

Unit tests of rametfs.core.policy need no mount.  The wrapper-level tests run in both modes
(the ``ramet`` fixture of conftest: the shared FUSE daemon, or fallback mode forced on a data
directory).
The real case builds a virtual environment from a wheel made here with ``pip wheel`` (no
network: ``--no-index``), promotes without it and restores it through the mount.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
from click.testing import CliRunner

from conftest import cli_where, run
from rametfs import Ramet, RametError
from rametfs.core import policy
from rametfs.cli import main
from rametfs.client import RestoreError
from rametfs.sandbox import Host

POLICY = """\
# what a promote keeps
ephemeral = ["*.log", "tmp/", "*.tmp"]
shared = ["data/"]
durable = ["keep.log"]

[rebuildable.bundle]
paths = ["build/"]
inputs = ["src"]
command = "mkdir -p build && cat src/*.py > build/bundle.py"
check = ["test", "-s", "build/bundle.py"]
timeout = 60
"""


# ----- the parser and classifier ---------------------------------------------------------------

@pytest.mark.parametrize("pattern,path,is_dir,expected", [
    ("*.log", "a.log", False, True),
    ("*.log", "deep/er/a.log", False, True),
    ("*.log", "a.log.txt", False, False),
    ("tmp/", "tmp", True, True),
    ("tmp/", "tmp", False, False),          # directories only
    ("tmp/", "x/tmp", True, True),          # no inner "/": at any depth
    ("/tmp", "x/tmp", True, False),         # a leading "/" anchors
    ("src/*.py", "src/a.py", False, True),
    ("src/*.py", "src/x/a.py", False, False),
    ("src/*.py", "y/src/a.py", False, False),  # an inner "/" anchors
    ("src/**/a.py", "src/a.py", False, True),
    ("src/**/a.py", "src/x/y/a.py", False, True),
    ("a/**", "a/b/c", False, True),
    ("a/**", "a", True, False),
    ("?.c", "x.c", False, True),
    ("?.c", "xy.c", False, False),
    ("[ab].c", "b.c", False, True),
    ("[!ab].c", "b.c", False, False),
    (".venv/", ".venv", True, True),
    ("*", ".hidden", False, True),
])
def test_pattern_matches_whole_paths(pattern, path, is_dir, expected):
    pol = policy.load(f"ephemeral = [{json.dumps(pattern)}]".encode(), "p")
    assert (pol.classify(path, is_dir) == (policy.EPHEMERAL, None)) is expected


def test_classes_precedence_and_whole_directories():
    pol = policy.load(POLICY.encode(), "ramet.toml")
    assert pol.classify("src/a.py", False) is None
    assert pol.classify("x/y.log", False) == (policy.EPHEMERAL, None)
    assert pol.classify("keep.log", False) == (policy.DURABLE, None)  # durable wins a tie
    assert pol.classify("build", True) == (policy.REBUILDABLE, "bundle")
    assert pol.classify("data", True) == (policy.SHARED, None)
    # a directory of another class is handled whole: what is below takes its class
    assert pol.class_of("data/keep.log", False) == (policy.SHARED, None, "data")
    assert pol.class_of("build/x/y", False) == (policy.REBUILDABLE, "bundle", "build")
    assert pol.class_of("src/a.py", False) == (policy.DURABLE, None, "src/a.py")
    assert pol.may_match_below("src")  # "*.log" matches at any depth
    anchored = policy.load(b'ephemeral = ["out/tmp/"]', "p")
    assert (anchored.may_match_below(""), anchored.may_match_below("out"),
            anchored.may_match_below("out/tmp"), anchored.may_match_below("src")) == (
        True, True, False, False)
    assert [r.name for r in pol.recipes.values()] == ["bundle"]
    recipe = pol.recipes["bundle"]
    assert (recipe.command, recipe.check, recipe.inputs, recipe.timeout) == (
        ("sh", "-c", "mkdir -p build && cat src/*.py > build/bundle.py"),
        ("test", "-s", "build/bundle.py"), ("src",), 60.0)


@pytest.mark.parametrize("text,message", [
    ('ephemeral = ["a"\n', "ramet.toml, line 2: Unclosed array"),
    ('ephemeral = ["a"]\nshared = 3 4\n', "ramet.toml, line 2: "),
    ('shared = ["data/"]\n\nephemerl = ["x"]\n',
     "ramet.toml, line 3: unknown key 'ephemerl'"),
    ('ephemeral = [\n  "ok",\n  "!neg",\n]\n',
     "ramet.toml, line 3: ephemeral: pattern '!neg': negation"),
    ('durable = "src"\n', "ramet.toml, line 1: durable: expected a list of glob strings"),
    ('ephemeral = ["a/../b"]\n', "ramet.toml, line 1: ephemeral: pattern 'a/../b': empty"),
    ('[rebuildable.venv]\npaths = [".venv"]\n', "ramet.toml, line 1: rebuildable.venv: "
                                                "command is missing"),
    ('[rebuildable.venv]\npaths = [".venv"]\ncommand = "x"\ninputs = ["/etc/passwd"]\n',
     "ramet.toml, line 4: rebuildable.venv: input '/etc/passwd' must be a path inside"),
    ('[rebuildable.venv]\npaths = [".venv"]\ncommand = "x"\ntimeout = -1\n',
     "ramet.toml, line 4: rebuildable.venv: timeout must be a positive number"),
    ('[rebuildable.venv]\npaths = [".venv"]\ncommand = []\n',
     "ramet.toml, line 3: rebuildable.venv: command: expected a command string"),
    ('version = 2\n', "ramet.toml, line 1: version 2"),
    (b'ephemeral = ["\xff"]\n', "ramet.toml, line 1: not UTF-8"),
])
def test_malformed_policy_names_the_line(text, message):
    data = text if isinstance(text, bytes) else text.encode()
    with pytest.raises(policy.InvalidArgument) as info:
        policy.load(data, "ramet.toml")
    assert info.value.errno == errno.EINVAL
    assert str(info.value).startswith(message), str(info.value)


def test_input_digest_of_a_file_and_a_directory(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "a").write_bytes(b"alpha")
    (tmp_path / "d" / "e" / "b").write_bytes(b"")
    os.symlink("a", tmp_path / "d" / "l")
    os.mkfifo(tmp_path / "d" / "p")
    assert policy.path_digest(tmp_path, "d/a") == blake3.blake3(b"alpha").hexdigest()
    assert policy.path_digest(tmp_path, "d/l") == blake3.blake3(b"a").hexdigest()
    assert policy.path_digest(tmp_path, "d/p") == blake3.blake3(b"").hexdigest()
    lines = (f"f {blake3.blake3(b'alpha').hexdigest()} a\n" "d - e\n"
             f"f {blake3.blake3(b'').hexdigest()} e/b\n"
             f"l {blake3.blake3(b'a').hexdigest()} l\n" "o - p\n")
    assert policy.path_digest(tmp_path, "d") == blake3.blake3(lines.encode()).hexdigest()
    with pytest.raises(policy.InputError) as info:
        policy.path_digest(tmp_path, "missing")
    assert (info.value.errno, str(info.value)) == (errno.ENOENT, "input missing is missing")


class _Side:
    """rametfs.core.policy.Side with a given diff, over a directory."""

    def __init__(self, root: Path, changes: list[tuple[str, bytes]]):
        self.given = changes
        self.exists = policy.exists_under(root)
        self.asked: list[frozenset[str]] = []

    def changes(self, skip):
        self.asked.append(skip)
        return self.given
        yield


def test_apply_plans_what_a_promote_leaves_out_takes_and_stops_on(tmp_path):
    """policy.apply without a mount: the rules both modes run."""
    write(tmp_path, {"src/a.py": "A\n", "out/site/i.html": "<p>\n", "logs/x.log": "x",
                     "data/t.csv": "t\n", "keep/n.log": "n"})
    pol = policy.load(b'ephemeral = ["*.log"]\nshared = ["data/"]\n'
                      b'[rebuildable.site]\npaths = ["out/site/"]\ninputs = ["src", "gone"]\n'
                      b'command = "true"\n', "--policy")
    side = _Side(tmp_path, [("M", b"data/t.csv"), ("A", b"src/b.py")])
    root = policy.FsTree.root(os.fsencode(tmp_path))
    plan = policy.apply(pol, policy.FsTree(), root, side)
    assert (plan.skip, plan.shared, plan.inputs) == (
        frozenset({"keep/n.log", "logs/x.log", "out/site"}), ["data"], ["src", "gone"])
    assert plan.above == frozenset({"", "keep", "logs", "out"})
    assert side.asked == [plan.skip]  # the diff is asked for once, with what is left out
    assert plan.problems == ("shared path changed: M data/t.csv",
                             "recipe site: input gone is missing")
    with pytest.raises(policy.InvalidArgument) as info:
        plan.check()
    assert str(info.value) == ("promote stopped by the policy (--policy): shared path changed: "
                               "M data/t.csv; recipe site: input gone is missing")
    stopped = plan.stopped(policy.input_too_big("src"))
    assert (type(stopped), stopped.errno, str(stopped)) == (
        policy.InputError, errno.EFBIG, "promote stopped by the policy (--policy): input src "
        f"holds more than {policy.MAX_INPUT_BYTES} bytes")
    assert plan.stats() == {"policy": "--policy", "left_out": {
        "rebuildable": {"paths": 1, "files": 1, "bytes": 4},
        "ephemeral": {"paths": 2, "files": 2, "bytes": 2}}}
    assert [r["name"] for r in plan.recipes({"src": "s", "gone": "g"})] == ["site"]

    nothing = policy.apply(None, policy.FsTree(), root, side)  # no policy: no walk, no diff
    assert (nothing.classified.paths, nothing.skip, nothing.problems, nothing.stats(),
            nothing.recipes({}), len(side.asked)) == ([], frozenset(), (), {}, [], 1)
    nothing.check()


# ----- preview and promote, in both modes ------------------------------------------------------

def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def project(tmp_path) -> Path:
    root = tmp_path / "project"
    write(root, {"ramet.toml": POLICY, "src/a.py": "A = 1\n", "src/b.py": "B = 2\n",
                 "data/table.csv": "x,y\n1,2\n", "keep.log": "kept\n", "old.log": "12345\n"})
    return root


def snapshot_files(ramet: Ramet, sid: str, tmp_path: Path) -> dict[str, str]:
    """Every file of snapshot ``sid`` and its text, read from a fresh execution."""
    ex = ramet.create(sid)
    try:
        return {str(p.relative_to(ex.path)): os.fsdecode(p.read_bytes())
                for p in sorted(ex.path.rglob("*")) if p.is_file()}
    finally:
        ramet.release(ex)


def test_preview_then_promote_applies_the_policy(ramet, project, tmp_path):
    write(project, {"docs/readme.md": "read me\n", "docs/notes.log": "noise\n"})  # unchanged
    base = ramet.snapshot(project)
    ex = ramet.create(base, policy="tree")  # the harness trusts the tree's ramet.toml
    write(ex.path, {"src/c.py": "C = 3\n", "run.log": "log line\n", "tmp/scratch": "0123456789",
                    "x.tmp": "t", "build/bundle.py": "stale\n"})
    before = ex.diff()
    report = ex.preview()
    assert ex.diff() == before  # a preview changes nothing
    assert [(p["path"], p["class"], p["bytes"]) for p in report["paths"]] == [
        ("build/", "rebuildable", 6), ("data/", "shared", 8), ("docs/notes.log", "ephemeral", 6),
        ("docs/readme.md", "durable", 8), ("keep.log", "durable", 5),
        ("old.log", "ephemeral", 6), ("ramet.toml", "durable", len(POLICY)),
        ("run.log", "ephemeral", 9), ("src/a.py", "durable", 6), ("src/b.py", "durable", 6),
        ("src/c.py", "durable", 6), ("tmp/", "ephemeral", 10), ("x.tmp", "ephemeral", 1)]
    assert report["totals"] == {
        "durable": {"paths": 6, "files": 6, "bytes": 31 + len(POLICY)},
        "shared": {"paths": 1, "files": 1, "bytes": 8},
        "rebuildable": {"paths": 1, "files": 1, "bytes": 6},
        "ephemeral": {"paths": 5, "files": 5, "bytes": 32}}
    assert (report["ok"], report["policy"], report["problems"]) == (True, "ramet.toml", [])
    assert [(r["name"], r["outputs"], r["inputs"]) for r in report["recipes"]] == [
        ("bundle", ["build"], ["src"])]

    sid = ex.promote(label="with policy")
    assert snapshot_files(ramet, sid, tmp_path) == {
        "data/table.csv": "x,y\n1,2\n", "docs/readme.md": "read me\n", "keep.log": "kept\n",
        "ramet.toml": POLICY, "src/a.py": "A = 1\n", "src/b.py": "B = 2\n", "src/c.py": "C = 3\n"}
    record = next(s for s in ramet.snapshots() if s["id"] == sid)
    assert record["recipes"] == [{
        "name": "bundle", "outputs": ["build"],
        "inputs": [{"path": "src", "blake3": policy.path_digest(ex.path, "src")}],
        "command": ["sh", "-c", "mkdir -p build && cat src/*.py > build/bundle.py"],
        "check": ["test", "-s", "build/bundle.py"], "timeout": 60.0}]
    assert (record["policy"], record["left_out"]) == ("ramet.toml", {
        "rebuildable": {"paths": 1, "files": 1, "bytes": 6},
        "ephemeral": {"paths": 5, "files": 5, "bytes": 32}})
    assert (ex.path / "run.log").read_text() == "log line\n"  # the execution is untouched

    # a checkpoint without --policy keeps everything
    everything = ex.checkpoint()
    assert set(snapshot_files(ramet, everything, tmp_path)) == {
        "build/bundle.py", "data/table.csv", "docs/notes.log", "docs/readme.md", "keep.log",
        "old.log", "ramet.toml", "run.log",
        "src/a.py", "src/b.py", "src/c.py", "tmp/scratch", "x.tmp"}

    calls = []

    def runtime(execution, argv, timeout):  # an adapter: here it records and runs
        calls.append((execution.id, argv, timeout))
        return Host().run(execution, argv, timeout)

    restored = ramet.restore(sid, runtime=runtime)
    assert [(s.recipe, s.step, s.ok) for s in restored.steps] == [
        ("bundle", "inputs", True), ("bundle", "command", True), ("bundle", "check", True)]
    assert calls == [
        (restored.execution.id, ["sh", "-c", "mkdir -p build && cat src/*.py > build/bundle.py"],
         60.0),
        (restored.execution.id, ["test", "-s", "build/bundle.py"], 60.0)]
    assert (restored.execution.path / "build" / "bundle.py").read_text() == \
        "A = 1\nB = 2\nC = 3\n"
    ramet.release(restored.execution)
    ramet.release(ex)


def test_changed_shared_path_stops_the_promote(ramet, project, tmp_path):
    base = ramet.snapshot(project)
    ex = ramet.create(base)
    (ex.path / "data" / "table.csv").write_text("changed\n")
    (ex.path / "data" / "new.csv").write_text("new\n")
    (ex.path / "src" / "a.py").write_text("A = 10\n")
    count = len(ramet.snapshots())
    problems = ["shared path changed: A data/new.csv", "shared path changed: M data/table.csv"]
    assert ex.preview(policy="tree")["problems"] == problems
    with pytest.raises(RametError) as info:
        ex.promote(policy="tree")
    assert info.value.errno == errno.EINVAL
    assert str(info.value) == "promote stopped by the policy (ramet.toml): " + "; ".join(
        problems)
    assert len(ramet.snapshots()) == count  # nothing promoted
    ramet.release(ex)


def test_policy_given_at_promote_and_malformed_policies(ramet, project, tmp_path):
    base = ramet.snapshot(project)
    ex = ramet.create(base)
    strict = tmp_path / "strict.toml"
    strict.write_text('ephemeral = ["src/b.py", "data/"]\n')
    sid = ex.promote(policy=strict)  # instead of the tree's ramet.toml
    assert set(snapshot_files(ramet, sid, tmp_path)) == {
        "keep.log", "old.log", "ramet.toml", "src/a.py"}
    assert ex.preview(policy=strict)["totals"]["ephemeral"] == {
        "paths": 2, "files": 2, "bytes": 14}

    (ex.path / "ramet.toml").write_text(
        'shared = ["data/"]\n[rebuildable.x]\npaths = 3\ncommand = "true"\n')
    count = len(ramet.snapshots())
    for call in (ex.promote, ex.preview):
        with pytest.raises(RametError) as info:
            call(policy="tree")
        assert (info.value.errno, str(info.value)) == (
            errno.EINVAL, "ramet.toml, line 3: paths: expected a list of glob strings")
    assert len(ramet.snapshots()) == count
    ex.checkpoint()  # a checkpoint applies no tree policy
    (ex.path / "ramet.toml").write_text(
        'ephemeral = ["tmp/"]\n[rebuildable.x]\npaths = ["out/"]\n'
        'inputs = ["tmp/in", "conf"]\ncommand = "true"\n')
    write(ex.path, {"out/o": "", "tmp/in": ""})
    with pytest.raises(RametError) as info:
        ex.promote(policy="tree")
    assert str(info.value) == (
        "promote stopped by the policy (ramet.toml): recipe x: input tmp/in is ephemeral "
        "(tmp), so a promote would not keep it; recipe x: input conf is missing")
    ramet.release(ex)


def test_restore_names_the_recipe_that_fails(ramet, tmp_path):
    root = tmp_path / "p"
    write(root, {"ramet.toml": """\
[rebuildable.first]
paths = ["one/"]
command = "mkdir -p one && echo clobbered >> conf/second.cfg"

[rebuildable.second]
paths = ["two/"]
inputs = ["conf/second.cfg"]
command = "mkdir -p two"
""", "conf/second.cfg": "v1\n", "one/x": "1", "two/y": "2"})
    ex = ramet.create(ramet.snapshot(root))
    sid = ex.promote(policy="tree")
    seen = []
    with pytest.raises(RestoreError) as info:
        ramet.restore(sid, runtime="host", on_step=seen.append)
    err = info.value
    assert err.errno == errno.EIO
    assert [(s.recipe, s.step, s.ok) for s in err.steps] == [
        ("first", "inputs", True), ("first", "command", True), ("second", "inputs", False)]
    assert seen == err.steps
    assert "recipe second: inputs failed: input conf/second.cfg changed" in str(err)
    assert (err.execution.path / "conf" / "second.cfg").read_text() == "v1\nclobbered\n"
    ramet.release(err.execution)  # it was left for inspection

    (ex.path / "ramet.toml").write_text(
        '[rebuildable.first]\npaths = ["one/"]\ncommand = "true"\n'
        'check = "echo not ready >&2; exit 3"\n')
    sid = ex.promote(policy="tree")
    with pytest.raises(RestoreError) as info:
        ramet.restore(sid, runtime="host")
    assert [(s.recipe, s.step, s.ok) for s in info.value.steps][-1] == ("first", "check", False)
    assert str(info.value).endswith(
        "recipe first: check failed: echo not ready >&2; exit 3 exited 3; "
        "output ends with:\nnot ready")
    ramet.release(info.value.execution)

    result = CliRunner().invoke(main, ["restore", *cli_where(ramet), sid, "--name", "inspect-me",
                                       "--runtime", "host"])
    assert result.exit_code == 1  # EIO
    assert result.stdout == "inspect-me\n"  # kept for inspection
    assert [line.split(" (")[0] for line in result.stderr.splitlines()] == [
        "first: inputs ok", "first: command ok", "first: check FAILED", "not ready",
        f"rametfs: restore of {sid[:12]} into execution inspect-me: recipe first: check "
        "failed: echo not ready >&2; exit 3 exited 3; output ends with:", "not ready"]
    assert (ramet.execution("inspect-me").path / "conf" / "second.cfg").exists()
    ramet.release("inspect-me")

    (ex.path / "ramet.toml").write_text(
        '[rebuildable.slow]\npaths = ["one/"]\ncommand = ["sleep", "30"]\ntimeout = 0.2\n')
    sid = ex.promote(policy="tree")
    with pytest.raises(RestoreError) as info:
        ramet.restore(sid, runtime="host")
    assert (info.value.errno, str(info.value).split(": ", 1)[1]) == (
        errno.ETIMEDOUT, "recipe slow: command failed: sleep 30 timed out after 0.2 s")
    ramet.release(info.value.execution)
    ramet.release(ex)


# ----- control files and the CLI (FUSE) -----------------------------------------------------

def test_preview_file_and_cli(shared_daemon, project):
    d = shared_daemon
    ex = d.ctl(f"create {d.snapshot(project)} --policy tree")["execution"]
    path = d.exec_path(ex)
    (path / "run.log").write_text("log\n")
    text = (path / ".ramet" / "preview").read_text()
    report = json.loads(text)
    assert [(p["path"], p["class"]) for p in report["paths"]][:4] == [
        ("data/", "shared"), ("keep.log", "durable"), ("old.log", "ephemeral"),
        ("ramet.toml", "durable")]
    assert ".ramet" not in run("ls", "-a", path).stdout.split()
    result = CliRunner().invoke(main, ["preview", "-m", str(d.mnt), ex])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[:3] == [f"shared      {8:>12} data/", f"durable     {5:>12} keep.log",
                         f"ephemeral   {6:>12} old.log"]
    assert lines[-5:] == ["CLASS        PATHS  FILES  BYTES",
                          f"durable      4      4      {17 + len(POLICY)}B",
                          "shared       1      1      8B", "rebuildable  0      0      0B",
                          "ephemeral    2      2      10B"]
    (path / "ramet.toml").write_text("ephemeral = [\n")
    with pytest.raises(OSError) as info:
        (path / ".ramet" / "preview").read_text()
    assert info.value.errno == errno.EINVAL
    assert (path / ".ramet" / "error").read_text().startswith(
        "preview: ramet.toml, line 2: ")
    d.ctl(f"release {ex}")


# ----- the real case: a virtual environment rebuilt offline ------------------------------------

@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """A wheel of a tiny local package, built offline by ``pip wheel``."""
    top = tmp_path_factory.mktemp("wheel")
    write(top / "tinypkg", {
        "pyproject.toml": '[build-system]\nrequires = ["setuptools", "wheel"]\n'
                          'build-backend = "setuptools.build_meta"\n\n'
                          '[project]\nname = "tinypkg"\nversion = "1.0"\n',
        "tinypkg/__init__.py": "VALUE = 42\n"})
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation",
        "-q", "-w", top / "wheels", top / "tinypkg")
    return top / "wheels"


def test_venv_project_promoted_without_its_venv_and_restored(shared_daemon, wheelhouse,
                                                            tmp_path):
    py = sys.executable
    root = tmp_path / "app"
    write(root, {
        "ramet.toml": f"""\
ephemeral = ["*.log", "tmp/"]

[rebuildable.venv]
paths = [".venv/"]
inputs = ["requirements.txt", "wheels"]
command = "{py} -m venv --without-pip .venv && {py} -m pip --python .venv/bin/python install -q --no-index --find-links wheels -r requirements.txt"
check = [".venv/bin/python", "-c", "import tinypkg; assert tinypkg.VALUE == 42"]

[rebuildable.build]
paths = ["build/"]
inputs = ["main.py"]
command = "mkdir -p build && cp main.py build/app.py"
check = "test -f build/app.py"
""",
        "requirements.txt": "tinypkg==1.0\n", "main.py": "import tinypkg\n"})
    (root / "wheels").mkdir()
    for wheel in wheelhouse.iterdir():
        (root / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    ramet = Ramet(shared_daemon.mnt)
    ex = ramet.create(ramet.snapshot(root), policy="tree")
    venv = [py, "-m", "venv", "--without-pip", ".venv"]
    run(*venv, cwd=ex.path)
    run(py, "-m", "pip", "--python", ".venv/bin/python", "install", "-q", "--no-index",
        "--find-links", "wheels", "-r", "requirements.txt", "--log", "pip.log", cwd=ex.path)
    write(ex.path, {"build/app.py": "import tinypkg\n", "tmp/t": "scratch", "run.log": "ran\n"})
    run(ex.path / ".venv/bin/python", "-c", "import tinypkg", cwd=ex.path)

    report = ex.preview()
    left_out = {p["path"]: (p["class"], p.get("recipe")) for p in report["paths"]
                if p["class"] != "durable"}
    assert left_out == {".venv/": ("rebuildable", "venv"), "build/": ("rebuildable", "build"),
                        "pip.log": ("ephemeral", None), "run.log": ("ephemeral", None),
                        "tmp/": ("ephemeral", None)}
    assert report["totals"]["rebuildable"]["files"] > 10
    sid = ex.promote()
    files = snapshot_files(ramet, sid, tmp_path)
    assert sorted(files) == ["main.py", "ramet.toml", "requirements.txt",
                             f"wheels/{next(wheelhouse.iterdir()).name}"]
    record = next(s for s in ramet.snapshots() if s["id"] == sid)
    assert [(r["name"], [i["path"] for i in r["inputs"]]) for r in record["recipes"]] == [
        ("venv", ["requirements.txt", "wheels"]), ("build", ["main.py"])]
    assert record["recipes"][0]["inputs"][0]["blake3"] == \
        blake3.blake3(b"tinypkg==1.0\n").hexdigest()

    result = CliRunner().invoke(main, ["restore", "-m", str(shared_daemon.mnt), sid,
                                       "--runtime", "host"])
    assert result.exit_code == 0, result.output
    restored = result.stdout.strip()
    steps = [line.split(" (")[0] for line in result.stderr.splitlines()]
    assert steps == ["venv: inputs ok", "venv: command ok", "venv: check ok",
                     "build: inputs ok", "build: command ok", "build: check ok"]
    path = shared_daemon.exec_path(restored)
    out = run(path / ".venv/bin/python", "-c", "import tinypkg; print(tinypkg.VALUE)", cwd=path)
    assert out.stdout == "42\n"
    assert (path / "build" / "app.py").read_text() == "import tinypkg\n"
    assert not (path / "run.log").exists()
    for eid in (restored, ex.id):
        ramet.release(eid)
    fsck = run(sys.executable, "-m", "rametfs", "fsck", "--data", shared_daemon.data_dir)
    assert fsck.stdout == "" and "; 0 problems" in fsck.stderr
