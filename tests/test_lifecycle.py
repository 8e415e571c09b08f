"""Snapshot lifecycle through the real mount and in fallback mode: names, rm (docs/lifecycle.md).

Each test runs in both modes (the ``ramet`` fixture) and drives the real CLI where a user
would; values are the ids the commands printed.
"""

from __future__ import annotations

import errno
import os
import sys

import pytest

from conftest import cli_where, run
from rametfs.client import RametError

RAMETFS = (sys.executable, "-m", "rametfs")


def cli(ramet, *args: str, check: bool = False):
    return run(*RAMETFS, *args, *cli_where(ramet), check=check)


def tree(tmp_path, name: str, files: dict[str, bytes]):
    root = tmp_path / name
    root.mkdir()
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    return root


def test_a_name_resolves_everywhere_a_snapshot_is_taken_and_moves(ramet, tmp_path):
    one = ramet.snapshot(tree(tmp_path, "one", {"a.txt": b"one\n"}))
    two = ramet.snapshot(tree(tmp_path, "two", {"a.txt": b"two\n"}))
    tag = f"main-{os.getpid()}-{tmp_path.name}"  # the shared daemon keeps names of others
    made = cli(ramet, "name", tag, one[:8], check=True)
    assert made.stdout == f"{tag} -> {one}\n"
    assert ramet.resolve(tag) == one
    ex = ramet.create(tag)
    assert (ex.path / "a.txt").read_bytes() == b"one\n"
    assert ex.status()["base"] == one
    moved = cli(ramet, "name", tag, two[:12], check=True)
    assert moved.stdout == f"{tag} -> {two} (was {one})\n"
    assert ramet.create(tag).status()["base"] == two
    listed = {s["id"]: s["names"] for s in ramet.snapshots()}
    assert (listed[one], listed[two]) == ([], [tag])
    ls = cli(ramet, "ls", check=True).stdout
    tid = {s["id"]: s["tree"] for s in ramet.snapshots()}[two]
    assert any(line.split()[:3] == [two[:12], tid[:12], tag] for line in ls.splitlines())
    assert cli(ramet, "log", tag, check=True).stdout.split()[0] == two
    gone = cli(ramet, "name", "--delete", tag, check=True)
    assert gone.stdout == f"deleted name {tag} (was {two})\n"
    with pytest.raises(RametError) as info:
        ramet.resolve(tag)
    assert info.value.errno == errno.ENOENT
    assert "no such snapshot name" in str(info.value)


@pytest.mark.parametrize("bad, why", [
    ("deadbeef", "ambiguous with a snapshot id prefix"),
    ("DEADBEEF0123", "ambiguous with a snapshot id prefix"),
    ("a..b", "holds .."),
    ("a/.b", "starts with ."),
    ("x.lock", "ends with .lock"),
    ("-x", "starts with -"),
    ("a b", "only ASCII letters"),
    ("a/", "ends with . or /"),
    ("", "it is empty"),
])
def test_bad_names_are_einval_saying_why(ramet, tmp_path, bad, why):
    snap = ramet.snapshot(tree(tmp_path, "src", {"f": b"x"}))
    with pytest.raises(RametError) as info:
        ramet.name(bad, snap)
    assert info.value.errno == errno.EINVAL
    assert why in str(info.value)


def test_short_hex_names_are_names(ramet, tmp_path):
    snap = ramet.snapshot(tree(tmp_path, "src", {"f": b"x"}))
    short = f"cafe{os.getpid() % 1000:03d}"[:7]  # 7 hex-ish characters: not a prefix
    ramet.name(short, snap)
    assert ramet.resolve(short) == snap
    ramet.unname(short)


def test_rm_refuses_while_used_and_force_says_what_goes(ramet, tmp_path):
    base = ramet.snapshot(tree(tmp_path, "src", {"f": b"base\n"}))
    ex = ramet.create(base)
    (ex.path / "f").write_bytes(b"promoted\n")
    head = ex.promote()
    tag = f"keep-{os.getpid()}-{tmp_path.name}"
    ramet.name(tag, head)
    refused = cli(ramet, "rm", base)
    assert refused.returncode == 5, refused.stderr  # EBUSY
    assert refused.stderr == (f"rametfs: rm: snapshot {base[:12]}: it is the base of "
                              f"execution {ex.id}: reset the execution onto another snapshot "
                              "(reset --base or --to), release it, or drop the pool, first\n")
    refused = cli(ramet, "rm", "--force", tag)  # the head: reset returns to it
    assert refused.returncode == 5
    assert refused.stderr == (f"rametfs: rm: snapshot {head[:12]}: it is the head of "
                              f"execution {ex.id}: reset the execution onto another snapshot "
                              "(reset --base or --to), release it, or drop the pool, first\n")
    assert cli(ramet, "rm", "--force", base).returncode == 5  # a base even with --force
    (ex.path / "g").write_bytes(b"more\n")
    after = ex.promote()  # now the head; the layer still lies over the base
    refused = cli(ramet, "rm", head)
    assert (refused.returncode, refused.stderr) == (
        5, f"rametfs: rm: snapshot {head[:12]}: name {tag!r} points at it: --force deletes "
           "the names\n")
    forced = cli(ramet, "rm", "--force", tag, check=True)
    assert forced.stdout == f"removed {head}; deleted name {tag}\n"
    ids = [s["id"] for s in ramet.snapshots()]
    assert head not in ids and base in ids and after in ids
    with pytest.raises(RametError):
        ramet.resolve(tag)
    record = next(s for s in ramet.snapshots() if s["id"] == after)
    assert record["parents"] == [head]
    assert cli(ramet, "log", after, check=True).stdout.split("\n")[0].split()[0] == after
    assert len(cli(ramet, "log", after, check=True).stdout.splitlines()) == 1  # stops there
    missing = cli(ramet, "rm", head)
    assert (missing.returncode, missing.stderr) == (
        3, f"rametfs: no snapshot {head!r}\n")
    short = cli(ramet, "log", "ff")
    assert (short.returncode, short.stderr) == (
        3, "rametfs: no snapshot 'ff': give at least 8 hex digits\n")


def test_rm_of_a_parent_forgets_it_and_keeps_the_child(ramet, tmp_path):
    base = ramet.snapshot(tree(tmp_path, "src", {"f": b"base\n"}))
    ex = ramet.create(base)
    (ex.path / "f").write_bytes(b"one\n")
    first = ex.promote()
    (ex.path / "f").write_bytes(b"two\n")
    second = ex.promote()  # its parent: first, the head then
    assert [line.split()[0] for line in
            cli(ramet, "log", second[:8], check=True).stdout.splitlines()] == \
        [second, first, base]
    assert cli(ramet, "rm", first, check=True).stdout == f"removed {first}\n"
    ids = {s["id"]: s for s in ramet.snapshots()}
    assert first not in ids and ids[second]["parents"] == [first]
    assert [line.split()[0] for line in
            cli(ramet, "log", second, check=True).stdout.splitlines()] == [second]
