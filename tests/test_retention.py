"""Retention (``forget``), ``log EXECUTION`` and equal trees (docs/lifecycle.md).

The rule (rametfs.core.retention) is tested as the pure function it is, with times given;
``forget`` then runs through the real mount (a daemon of its own: forget reaches every
snapshot of a store, so the shared daemon's would go) and in fallback mode, from the CLI.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import secrets
import sys

import pytest

from conftest import cli_where, ctl_command, run
from rametfs.client import Ramet, RametError
from rametfs.core.retention import Duration, Policy, plan
from rametfs.errors import InvalidArgument

RAMETFS = (sys.executable, "-m", "rametfs")
HOUR_NS = 3600 * 10**9


def cli(ramet, *args: str, check: bool = False):
    return run(*RAMETFS, *args, *cli_where(ramet), check=check)


def utc_ns(*when: int) -> int:
    return int(datetime.datetime(*when, tzinfo=datetime.timezone.utc).timestamp()) * 10**9


@pytest.fixture(params=["fuse", "fallback"])
def own(request, tmp_path):
    """The wrapper on a store of this test's own: a fresh daemon's mount, or fallback mode."""
    if request.param == "fuse":
        yield Ramet(request.getfixturevalue("daemon").mnt)
    else:
        with Ramet(data=tmp_path / "data", mode="fallback") as r:
            yield r


def snapshots_of(ramet, tmp_path, count: int) -> list[str]:
    """``count`` snapshots of one directory, each with another content, oldest first,
    labelled s0, s1, ..."""
    src = tmp_path / "src"
    src.mkdir()
    ids = []
    for i in range(count):
        (src / "f").write_text(f"version {i}\n")
        ids.append(ramet.snapshot(src, label=f"s{i}"))
    return ids


# ----- the rule, pure ---------------------------------------------------------------------

@pytest.mark.parametrize("text, parts", [
    ("7d", (0, 0, 7, 0)), ("36h", (0, 0, 0, 36)), ("1y2m", (1, 2, 0, 0)),
    ("2y5m7d3h", (2, 5, 7, 3)), ("0y1h", (0, 0, 0, 1)), ("1000d", (0, 0, 1000, 0)),
])
def test_durations_are_restics(text, parts):
    assert Duration.parse(text) == Duration(*parts)


@pytest.mark.parametrize("text", ["", "0d", "7", "d", "2h30m", "7d1y", "1d1d", "1w", "-1d",
                                  "1.5d", "7D", " 7d", "1001y"])
def test_other_durations_are_einval_naming_the_units(text):
    with pytest.raises(InvalidArgument) as info:
        Duration.parse(text)
    assert info.value.errno == errno.EINVAL
    assert f"bad duration {text!r}: give whole numbers of y (years), m (months)" in str(info.value)


def test_months_and_years_count_by_the_calendar_as_restic_does():
    assert Duration.parse("1m").before(utc_ns(2023, 3, 31)) == utc_ns(2023, 3, 3)  # Feb 31
    assert Duration.parse("1m").before(utc_ns(2024, 3, 31)) == utc_ns(2024, 3, 2)  # leap
    assert Duration.parse("1y2m3d6h").before(utc_ns(2024, 1, 1, 5)) == utc_ns(2022, 10, 28, 23)
    assert Duration.parse("7d").before(utc_ns(2024, 3, 3) + 5) == utc_ns(2024, 2, 25) + 5


def test_the_rules_add_up_newest_first_and_uses_are_always_kept():
    newest = utc_ns(2024, 6, 10, 12)
    snaps = [("a", newest), ("b", newest - 1 * HOUR_NS), ("c", newest - 24 * HOUR_NS),
             ("d", newest - 25 * HOUR_NS), ("e", newest - 72 * HOUR_NS),
             ("f", newest - 96 * HOUR_NS)]
    names = {"release/1": "e", "main": "d", "release/2": "b"}
    uses = {"f": ["base of execution e1"]}
    got = plan(reversed(snaps), names, uses,
               Policy(keep_last=1, keep_within=Duration(days=1), keep_name="release/*"))
    assert got.keep == {"a": ["last 1", "within 1d"], "b": ["within 1d", "name release/2"],
                        "e": ["name release/1"], "f": ["base of execution e1"]}
    # c is exactly 1d older than the newest: restic keeps only times after the cutoff.
    assert got.forget == ["c", "d"]
    assert plan(snaps, names, {}, Policy(keep_last=3)).forget == ["d", "e", "f"]
    assert plan([], {}, {}, Policy(keep_within=Duration(hours=1))) == plan([], {}, {}, Policy(
        keep_last=1))


def test_keep_within_counts_from_the_newest_snapshot_not_the_clock():
    old = utc_ns(2001, 1, 1)  # long ago: a clock-based rule would keep nothing
    got = plan([("x", old), ("y", old - 2 * HOUR_NS), ("z", old - 3 * HOUR_NS)], {}, {},
               Policy(keep_within=Duration(hours=2)))
    assert (got.keep, got.forget) == ({"x": ["within 2h"]}, ["y", "z"])


def test_equal_times_are_ordered_by_id():
    got = plan([("b", 5), ("a", 5), ("c", 5)], {}, {}, Policy(keep_last=2))
    assert (list(got.keep), got.forget) == (["c", "b"], ["a"])


@pytest.mark.parametrize("policy, message", [
    ({}, "forget: give at least one of --keep-last, --keep-within, --keep-name"),
    ({"keep_last": 0}, "forget: --keep-last must be at least 1, not 0"),
])
def test_an_empty_policy_is_einval(policy, message):
    with pytest.raises(InvalidArgument) as info:
        Policy(**policy)
    assert str(info.value).startswith(message)


# ----- forget through the mount and in fallback mode ------------------------------------

def test_forget_keeps_by_each_rule_and_by_use_and_the_dry_run_says_why(own, tmp_path):
    s = snapshots_of(own, tmp_path, 6)
    ex = own.create(s[1])  # its base: always kept
    (ex.path / "f").write_text("promoted\n")
    head = ex.promote(label="head")  # its head: always kept; now the newest snapshot
    own.name("release/1", s[2])
    own.name("scratch", s[0])  # a name the pattern does not keep: it goes with s0
    dry = cli(own, "forget", "--keep-last", "2", "--keep-name", "release/*", "--dry-run",
              check=True)
    assert dry.stdout == (
        "keep 4 snapshots:\n"
        f"  {head[:12]}  head  last 2, head of execution {ex.id}\n"
        f"  {s[5][:12]}  s5  last 2\n"
        f"  {s[2][:12]}  s2  name release/1\n"
        f"  {s[1][:12]}  s1  base of execution {ex.id}\n"
        "would remove 3 snapshots:\n"
        f"  {s[4][:12]}  s4\n"
        f"  {s[3][:12]}  s3\n"
        f"  {s[0][:12]}  s0\n"
        "would delete name scratch\n")
    assert [x["id"] for x in own.snapshots()] == [*s, head]  # nothing changed
    reply = json.loads(cli(own, "forget", "--keep-last", "2", "--keep-name", "release/*",
                           "--prune", "--json", check=True).stdout)
    assert reply["removed"] == [s[4], s[3], s[0]]
    assert [k["snapshot"] for k in reply["kept"]] == [head, s[5], s[2], s[1]]
    assert reply["names"] == ["scratch"] and reply["dry_run"] is False
    # gc freed the forgotten snapshots' own contents: their file f, 10 bytes each
    assert (reply["gc"]["contents"], reply["gc"]["trees"]) == (3, 3)
    assert [x["id"] for x in own.snapshots()] == [s[1], s[2], s[5], head]
    assert {x["id"]: x["names"] for x in own.snapshots()}[s[2]] == ["release/1"]
    with pytest.raises(RametError) as info:
        own.resolve("scratch")
    assert info.value.errno == errno.ENOENT
    if own.mode == "fuse":
        assert not (own.mount / "snapshots" / s[4]).exists()
        assert (own.mount / "snapshots" / s[5] / "f").read_text() == "version 5\n"
    else:
        assert run(*RAMETFS, "fsck", "--data", own.data).returncode == 0
    assert (ex.path / "f").read_text() == "promoted\n"


def test_forget_keep_within_counts_back_from_the_newest(own, tmp_path):
    s = snapshots_of(own, tmp_path, 3)
    reply = own.forget(keep_within="1h")  # all three were made within a second
    assert (reply["removed"], [k["snapshot"] for k in reply["kept"]]) == ([], s[::-1])
    assert [k["reasons"] for k in reply["kept"]] == [["within 1h"]] * 3
    reply = own.forget(keep_last=1, dry_run=True)
    assert reply["removed"] == [s[1], s[0]] and [x["id"] for x in own.snapshots()] == s


@pytest.mark.parametrize("args, message", [
    ((), "forget: give at least one of --keep-last, --keep-within, --keep-name"),
    (("--keep-last", "0"), "--keep-last must be a whole number >= 1, not '0'"),
    (("--keep-within", "2h30m"), "bad duration '2h30m': give whole numbers of y (years)"),
])
def test_forget_without_a_rule_or_with_a_bad_one_is_einval(own, tmp_path, args, message):
    snapshots_of(own, tmp_path, 1)
    got = cli(own, "forget", *args)
    assert got.returncode == 4, got.stderr  # EINVAL
    assert got.stderr.startswith(f"rametfs: {message}")
    assert len(own.snapshots()) == 1


def test_an_execution_cannot_forget_anything(shared_daemon, tmp_path):
    ramet = Ramet(shared_daemon.mnt)
    base = snapshots_of(ramet, tmp_path, 2)[0]
    ex = ramet.create(base)
    before = [s["id"] for s in ramet.snapshots()]
    with pytest.raises(OSError) as info:
        ctl_command(ex.path / ".ramet" / "ctl", "forget --keep-last 1")
    assert info.value.errno == errno.EINVAL
    assert info.value.reply["error"].startswith(
        "forget: a command of the root .ramet/ctl, at the top of the mount (the harness's)")
    assert [s["id"] for s in ramet.snapshots()] == before


# ----- log EXECUTION, equal trees ---------------------------------------------------------

def test_log_of_an_execution_is_its_head_and_ancestry_marking_the_base(ramet, tmp_path):
    base = snapshots_of(ramet, tmp_path, 1)[0]
    ex = ramet.create(base)
    assert cli(ramet, "log", ex.id, check=True).stdout.split("\n")[0].split()[:3] == \
        [base, "(head)", "(base)"]
    (ex.path / "f").write_text("one\n")
    first = ex.promote(label="one")
    (ex.path / "f").write_text("two\n")
    second = ex.promote(label="two")
    lines = [line.split() for line in cli(ramet, "log", ex.id, check=True).stdout.splitlines()]
    assert [line[0] for line in lines] == [second, first, base]
    assert (lines[0][1], lines[2][1]) == ("(head)", "(base)")
    assert "(head)" not in lines[1] and "(base)" not in lines[1]
    assert [line[-1] for line in lines] == ["two", "one", "s0"]
    assert "(head)" not in cli(ramet, "log", second, check=True).stdout  # a snapshot's log
    missing = cli(ramet, "log", "no-such-thing")
    assert (missing.returncode, missing.stderr) == (
        3, "rametfs: no snapshot 'no-such-thing': no such snapshot name, and not an id "
           "prefix\n")


def test_the_same_directory_snapshotted_twice_has_the_same_tree(ramet, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f").write_bytes(b"same\n")
    (src / "g").write_bytes(b"g\n")
    one = ramet.snapshot(src)
    two = ramet.snapshot(src)
    (src / "g").write_bytes(b"G\n")
    three = ramet.snapshot(src)
    trees = {x["id"]: x["tree"] for x in ramet.snapshots()}
    assert one != two and trees[one] == trees[two] and trees[three] != trees[one]
    assert len(trees[one]) == 64
    ls = cli(ramet, "ls", check=True).stdout.splitlines()
    assert ls[2].split()[:3] == ["SNAPSHOT", "TREE", "NAMES"]
    cells = {line.split()[0]: line.split()[1] for line in ls[3:ls.index("", 3)]}
    assert cells[one[:12]] == cells[two[:12]] == trees[one][:12]
    assert cells[three[:12]] == trees[three][:12]
    status = json.loads(cli(ramet, "status", check=True).stdout)
    assert {x["id"]: x["tree"] for x in status["snapshots"]}[two] == trees[one]
    # An execution promoted without a change keeps its base's tree.
    ex = ramet.create(one)
    same = ex.promote()
    assert {x["id"]: x["tree"] for x in ramet.snapshots()}[same] == trees[one]


# ----- a pool's --keep-last -----------------------------------------------------------------

def test_a_pool_keeps_its_last_promotes_and_the_named_ones(ramet, tmp_path):
    base = snapshots_of(ramet, tmp_path, 1)[0]
    other = ramet.create(base)  # not a member: its promotes are not the pool's
    (other.path / "f").write_text("other\n")
    outside = other.promote()
    name = f"keep{os.getpid()}{secrets.token_hex(3)}"
    promotes, listed = [], []
    with ramet.execution_pool(base, 1, name=name, keep_last=2) as pool:
        assert {p["name"]: p["keep_last"] for p in ramet.pools()}[name] == 2
        for i in range(4):
            with pool.acquire() as ex:
                (ex.path / "f").write_text(f"p{i}\n")
                promotes.append(ex.promote(label=f"p{i}"))
            if i == 1:
                ramet.name(f"{name}/p1", promotes[1])
            ids = {s["id"] for s in ramet.snapshots()}
            listed.append([i for i, sid in enumerate(promotes) if sid in ids])
        with pytest.raises(RametError) as info:
            ramet.execution_pool(base, 1, name=name, keep_last=3)
        assert info.value.errno == errno.EEXIST
        assert f"pool {name!r} exists with --keep-last 2, not 3" in str(info.value)
        pool.drop()
    # p0 went at the third promote; p1 stayed, named; p2 and p3 are the last two.
    assert listed == [[0], [0, 1], [1, 2], [1, 2, 3]]
    ids = {s["id"] for s in ramet.snapshots()}
    assert {base, outside} <= ids
    if ramet.mode == "fuse":
        assert not (ramet.mount / "snapshots" / promotes[0]).exists()


def test_pool_keep_last_must_be_a_count(ramet, tmp_path):
    base = snapshots_of(ramet, tmp_path, 1)[0]
    with pytest.raises(RametError) as info:
        ramet.execution_pool(base, 1, keep_last=0)
    assert (info.value.errno, str(info.value)) == (
        errno.EINVAL, "--keep-last must be a whole number >= 1, not '0'")
