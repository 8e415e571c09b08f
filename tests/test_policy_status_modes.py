"""Policy application and status, in both modes: one suite, so the daemon and fallback mode
cannot drift apart again (both apply a policy with rametfs.core.policy.apply_steps and build
their status with rametfs.core.status).

Each test takes the ``ramet`` fixture (conftest): a ``Ramet`` on the shared FUSE daemon, or
``Ramet(data=DIR, mode="fallback")``, and asserts whole previews, whole messages and whole
status records, the same expected values for both modes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import rametfs
from rametfs import Ramet, RametError
from rametfs.core.policy import MAX_INPUT_BYTES, MAX_POLICY_BYTES
from test_snapshots import write_tree

POLICY = """\
ephemeral = ["tmp/", "*.log"]
shared = ["data/", "vendor/lib"]

[rebuildable.site]
paths = ["site/"]
inputs = ["docs", "tmp/in", "gone", "link/index.md"]
command = "true"
"""
FIXED = """\
ephemeral = ["tmp/", "*.log"]
shared = ["data/", "vendor/lib"]

[rebuildable.site]
paths = ["site/"]
inputs = ["docs"]
command = "true"
"""


@pytest.fixture
def project(tmp_path) -> Path:
    root = write_tree(tmp_path / "project", {
        "ramet.toml": POLICY.encode(), "docs/index.md": b"# docs\n", "data/a.csv": b"a\n",
        "data/sp ace.csv": b"b,c\n", "vendor/lib": b"lib v1\n", "site/index.html": b"<p>\n",
        "tmp/in": b"in", "src/m.py": b"M = 1\n"})
    os.symlink("docs", root / "link")
    return root


def failure(call, **kwargs) -> tuple[int, str]:
    with pytest.raises(RametError) as caught:
        call(**kwargs)
    return caught.value.errno, str(caught.value)


def test_preview_totals_and_problems_are_the_same_in_both_modes(ramet, project):
    ex = ramet.create(ramet.snapshot(project), policy="tree")
    (ex.path / "data" / "a.csv").write_text("changed\n")
    (ex.path / "data" / "new\tfile").write_text("new\n")
    os.unlink(ex.path / "data" / "sp ace.csv")
    (ex.path / "vendor" / "lib").write_text("lib v2, longer\n")
    write_tree(ex.path, {"run.log": b"12345", "tmp/x": b"xyz", "src/n.py": b"N = 2\n"})
    problems = [
        'shared path changed: M data/a.csv', 'shared path changed: A "data/new\\tfile"',
        'shared path changed: D "data/sp ace.csv"', 'shared path changed: M vendor/lib',
        "recipe site: input tmp/in is ephemeral (tmp), so a promote would not keep it",
        "recipe site: input gone is missing",
        "recipe site: input link/index.md is missing"]  # through a symlink: not followed
    report = ex.preview()
    assert report == {
        "ok": False, "policy": "ramet.toml",
        "paths": [
            {"path": "data/", "class": "shared", "bytes": 12, "files": 2},
            {"path": "docs/index.md", "class": "durable", "bytes": 7, "files": 1},
            {"path": "link", "class": "durable", "bytes": 0, "files": 0},  # a symlink
            {"path": "ramet.toml", "class": "durable", "bytes": len(POLICY), "files": 1},
            {"path": "run.log", "class": "ephemeral", "bytes": 5, "files": 1},
            {"path": "site/", "class": "rebuildable", "bytes": 4, "files": 1,
             "recipe": "site"},
            {"path": "src/m.py", "class": "durable", "bytes": 6, "files": 1},
            {"path": "src/n.py", "class": "durable", "bytes": 6, "files": 1},
            {"path": "tmp/", "class": "ephemeral", "bytes": 5, "files": 2},
            {"path": "vendor/lib", "class": "shared", "bytes": 15, "files": 1}],
        "totals": {"durable": {"paths": 5, "files": 4, "bytes": 19 + len(POLICY)},
                   "shared": {"paths": 2, "files": 3, "bytes": 27},
                   "rebuildable": {"paths": 1, "files": 1, "bytes": 4},
                   "ephemeral": {"paths": 2, "files": 3, "bytes": 10}},
        "recipes": [{"name": "site", "outputs": ["site"],
                     "inputs": ["docs", "tmp/in", "gone", "link/index.md"],
                     "command": ["sh", "-c", "true"], "check": None, "timeout": 600.0}],
        "problems": problems}
    count = len(ramet.snapshots())
    assert failure(ex.promote) == (
        errno.EINVAL, "promote stopped by the policy (ramet.toml): " + "; ".join(problems))
    assert len(ramet.snapshots()) == count  # nothing promoted

    ex.reset()  # the shared paths equal the head again
    (ex.path / "ramet.toml").write_text(FIXED)
    write_tree(ex.path, {"run.log": b"12345", "src/n.py": b"N = 2\n"})
    assert ex.preview()["problems"] == []
    sid = ex.promote(label="fixed")
    record, = [s for s in ramet.snapshots() if s["id"] == sid]
    assert (record["policy"], record["left_out"], record["files"]) == ("ramet.toml", {
        "rebuildable": {"paths": 1, "files": 1, "bytes": 4},
        "ephemeral": {"paths": 2, "files": 2, "bytes": 7}}, 7)
    assert [(r["name"], r["outputs"], [i["path"] for i in r["inputs"]])
            for r in record["recipes"]] == [("site", ["site"], ["docs"])]
    ramet.release(ex)


@pytest.mark.parametrize("kind", ["symlink", "directory", "fifo", "too big"])
def test_a_tree_policy_that_is_not_a_small_regular_file_is_refused_alike(ramet, tmp_path, kind):
    ex = ramet.create(ramet.snapshot(write_tree(tmp_path / "p", {"a": b"a\n"})))
    target = ex.path / "ramet.toml"
    if kind == "symlink":
        (ex.path / "real.toml").write_text('ephemeral = ["a"]\n')
        os.symlink("real.toml", target)
    elif kind == "directory":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.write_text("#" * (MAX_POLICY_BYTES + 1))
    message = (f"ramet.toml is {MAX_POLICY_BYTES + 1} bytes: a policy is at most "
               f"{MAX_POLICY_BYTES}" if kind == "too big" else "ramet.toml is not a regular file")
    for call in (ex.preview, ex.promote):
        assert failure(call, policy="tree") == (errno.EINVAL, message)
    ramet.release(ex)


def test_an_input_past_the_limit_stops_the_promote_alike(ramet, tmp_path):
    policy = '[rebuildable.deps]\npaths = ["deps/"]\ninputs = ["lock.txt"]\ncommand = "true"\n'
    base = ramet.snapshot(write_tree(tmp_path / "p", {"lock.txt": b"a==1\n", "deps/x": b"x"}))
    (tmp_path / "policy.toml").write_text(policy)
    ex = ramet.create(base, policy=tmp_path / "policy.toml")
    os.truncate(ex.path / "lock.txt", 2 * MAX_INPUT_BYTES)  # sparse: nothing stored
    assert ex.preview()["problems"] == []  # a preview hashes no input
    assert failure(ex.promote) == (
        errno.EFBIG, f"promote stopped by the policy (create --policy): input lock.txt holds "
        f"more than {MAX_INPUT_BYTES} bytes")
    os.truncate(ex.path / "lock.txt", 5)
    assert ex.promote() == ex.status()["head"] != base
    ramet.release(ex)


ROOT_KEYS = {"mode", "pid", "data", "mount", "version", "copy_method", "open_less",
             "snapshots_bind", "snapshots", "executions", "pools", "last", "gc", "memory"}
RECORD_KEYS = {"execution", "id", "base", "head", "state", "created_ns", "upper_bytes",
               "upper_inodes", "captured_bytes", "max_bytes", "max_inodes", "last", "pool",
               "lease", "quarantine_reason", "failure", "waiting", "policy", "runtime", "path",
               "mode", "copy_method", "owner", "group", "share", "control"}


def test_status_has_the_same_keys_and_values_in_both_modes(ramet, tmp_path):
    base = ramet.snapshot(write_tree(tmp_path / "p", {"a.txt": b"a\n", "b.log": b"bb\n"}))
    (tmp_path / "policy.toml").write_text('ephemeral = ["*.log"]\n')
    ex = ramet.create(base, policy=tmp_path / "policy.toml")
    (ex.path / "c.txt").write_text("ccc\n")
    saved = ex.promote(label="status")
    ex.record_runtime("bubblewrap", uid=1000, gid=1000)
    root = ramet.status()
    assert set(root) == ROOT_KEYS
    fuse = ramet.mode == "fuse"
    assert (root["mode"], root["version"], root["mount"]) == (
        ramet.mode, rametfs.__version__, str(ramet.mount) if fuse else None)
    assert (root["pid"] == os.getpid()) is not fuse  # fallback runs in this process
    assert [root[key] is None for key in ("copy_method", "open_less", "snapshots_bind",
                                         "memory")] == [fuse, not fuse, not fuse, not fuse]
    record, = [e for e in root["executions"] if e["id"] == ex.id]
    assert set(record) == RECORD_KEYS
    # upper_bytes counts the stored records' bytes: the once-a-second flush of dirty records
    # may store one between the two reads
    assert {k: v for k, v in ex.status().items() if k != "upper_bytes"} == \
        {k: v for k, v in record.items() if k != "upper_bytes"}
    stats = record["last"]["stats"]
    assert (record["last"]["ok"], record["last"]["snapshot"], stats["files"], stats["bytes"],
            stats["policy"], stats["left_out"]) == (True, saved, 2, 6, "create --policy", {
                "rebuildable": {"paths": 0, "files": 0, "bytes": 0},
                "ephemeral": {"paths": 1, "files": 1, "bytes": 3}})
    fields = {key: record[key] for key in RECORD_KEYS - {"created_ns", "last", "upper_bytes",
                                                         "upper_inodes", "captured_bytes"}}
    assert fields == {
        "execution": ex.id, "id": ex.id, "base": base, "head": saved, "state": "ready",
        "pool": None, "lease": None, "quarantine_reason": None, "failure": None,
        "waiting": 0, "policy": "create --policy",
        "runtime": {"name": "bubblewrap", "uid": 1000, "gid": 1000}, "path": str(ex.path),
        "mode": ramet.mode, "copy_method": None if fuse else root["copy_method"],
        "owner": os.getuid(), "group": os.getgid(), "share": "0700", "control": "full",
        "max_bytes": None, "max_inodes": None}
    usage = (record["upper_bytes"], record["upper_inodes"], record["captured_bytes"])
    if fuse:  # its layer: the root and c.txt (a block and their records); the harness's
        assert usage[0] > 4096 and usage[1:] == (2, 0)  # promote is charged to no one
    else:  # not tracked
        assert usage == (None, None, None)
    ramet.release(ex)
