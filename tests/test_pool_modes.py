"""The pool and lease commands, in both modes: one suite, so the daemon and fallback mode
cannot drift apart again (both drive rametfs.core.pools).

Each test takes the ``ramet`` fixture (conftest): a ``Ramet`` on the shared FUSE daemon, or
``Ramet(data=DIR, mode="fallback")``, and sends the pool commands as lines parsed into
Commands (rametfs.protocol.parse), which the wrapper's backend runs (``_backend.run``),
comparing whole replies and messages.  Leases here are long: what
happens when one ends is tests/test_core_pools.py (a fake clock) and tests/test_leases.py
(real time, the daemon's lease task and fallback mode's take-over).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from pathlib import Path

import pytest

from rametfs import Ramet, RametError, protocol
from rametfs.store import Store, import_tree
from test_snapshots import write_tree

HOUR = "3600"
QUARANTINE_LOG = r"WARNING rametfs\.control\.commands: execution \S+ quarantined"
MEMBER = r"{pool}-[0-9a-f]{{8}}"


@pytest.fixture
def source(tmp_path) -> Path:
    return write_tree(tmp_path / "src", {"README": b"project\n", "src/main.py": b"print(1)\n"})


@pytest.fixture
def base_root(tmp_path, source) -> str:
    """The root tree id (hex) of ``source`` as a snapshot, from a store of the test's own:
    what a verification of an execution equal to its base names as ``root``."""
    store = Store(tmp_path / "oracle")
    try:
        return import_tree(store, source).root.ref.hex()
    finally:
        store.close()


def command(ramet: Ramet, verb: str, *positional: str, **options: str) -> dict:
    line = protocol.format_command(verb, *positional, **options)
    return ramet._backend.run(protocol.parse(line))


def failure(ramet: Ramet, verb: str, *positional: str, **options: str) -> tuple[int, str]:
    with pytest.raises(RametError) as caught:
        command(ramet, verb, *positional, **options)
    return caught.value.errno, str(caught.value)


def member(ramet: Ramet, eid: str) -> dict:
    record, = [e for e in ramet.executions() if e["id"] == eid]
    return {key: record[key] for key in ("pool", "state", "lease", "quarantine_reason")}


def pool_record(ramet: Ramet, name: str) -> dict:
    record, = [p for p in ramet.pools() if p["name"] == name]
    return record


def new_pool(ramet: Ramet, base: str, size: int) -> tuple[str, list[str]]:
    name = f"modes-{secrets.token_hex(3)}"  # the shared daemon holds other tests' pools
    reply = command(ramet, "pool", base, size=str(size), name=name)
    return name, reply["executions"]


def test_open_reattach_grow_and_the_pool_record(ramet, source):
    base = ramet.snapshot(source)
    name = f"modes-{secrets.token_hex(3)}"
    reply = command(ramet, "pool", base, size="2", name=name, share="0750")
    assert {k: v for k, v in reply.items() if k != "executions"} == {
        "ok": True, "pool": name, "snapshot": base, "size": 2, "created": True}
    assert len(reply["executions"]) == 2 == len(set(reply["executions"]))
    assert all(re.fullmatch(MEMBER.format(pool=name), eid) for eid in reply["executions"])
    assert reply["executions"] == sorted(reply["executions"])
    again = command(ramet, "pool", base, size="3", name=name)
    assert {k: v for k, v in again.items() if k != "executions"} == {
        "ok": True, "pool": name, "snapshot": base, "size": 3, "created": False}
    assert set(reply["executions"]) < set(again["executions"]) and len(again["executions"]) == 3
    record = pool_record(ramet, name)
    assert record == {
        "name": name, "base": base, "size": 3, "created_ns": record["created_ns"],
        "keep_last": None, "executions": again["executions"], "ready": 3, "leased": 0,
        "quarantined": 0,
        "owner": os.getuid(), "group": os.getgid(), "share": "0750", "control": "full",
        "max_bytes": None, "max_inodes": None}
    other = ramet.snapshot(source / "src")
    assert failure(ramet, "pool", other, size="1", name=name) == (
        errno.EEXIST, f"pool {name!r} exists with base {base}, not {other}")
    assert command(ramet, "drop", name) == {"ok": True, "pool": name,
                                            "executions": again["executions"]}
    assert name not in {p["name"] for p in ramet.pools()}
    assert not set(again["executions"]) & {e["id"] for e in ramet.executions()}


def test_acquire_renew_and_return_replies(ramet, source, base_root):
    base = ramet.snapshot(source)
    name, members = new_pool(ramet, base, 2)
    got = command(ramet, "acquire", name, holder="h1", ttl=HOUR, pid="42", host="box")
    eid = got["execution"]
    lease = got["lease"]
    assert got == {"ok": True, "execution": eid, "pool": name, "snapshot": base,
                   "path": str(ramet.execution(eid).path),
                   "lease": {"holder": "h1", "pid": 42, "host": "box",
                             "expires_ns": lease["acquired_ns"] + 3600 * 10**9,
                             "acquired_ns": lease["acquired_ns"]}}
    assert member(ramet, eid) == {"pool": name, "state": "leased", "lease": lease,
                                  "quarantine_reason": None}
    renewed = command(ramet, "renew", eid, holder="h1", ttl="7200")
    assert renewed == {"ok": True, "execution": eid,
                       "lease": {**lease, "expires_ns": renewed["lease"]["expires_ns"]}}
    assert renewed["lease"]["expires_ns"] >= lease["expires_ns"] + 3600 * 10**9

    (ramet.execution(eid).path / "scratch").write_text("mine\n")
    returned = command(ramet, "return", eid, holder="h1")
    assert returned == {
        "ok": True, "execution": eid, "pool": name, "state": "ready",
        "reset_ms": returned["reset_ms"],
        "verification": {"mode": "root", "equal": True, "root": base_root,
                         "base_root": base_root,
                         "verify_ms": returned["verification"]["verify_ms"],
                         "differences": []}}
    assert not (ramet.execution(eid).path / "scratch").exists()
    assert member(ramet, eid) == {"pool": name, "state": "ready", "lease": None,
                                  "quarantine_reason": None}
    # The one returned last goes out first.
    assert command(ramet, "acquire", name, holder="h2", ttl=HOUR)["execution"] == eid
    deep = command(ramet, "return", eid, holder="h2", verify="deep")
    assert (deep["state"], deep["verification"]["mode"], deep["verification"]["root"],
            deep["verification"]["equal"]) == ("ready", "deep", base_root, True)
    command(ramet, "drop", name)


def test_refusals_are_the_same_in_both_modes(ramet, source):
    base = ramet.snapshot(source)
    name, members = new_pool(ramet, base, 2)
    a = command(ramet, "acquire", name, holder="h1", ttl=HOUR, pid="42", host="box")["execution"]
    b = command(ramet, "acquire", name, holder="h2", ttl=HOUR)["execution"]
    assert failure(ramet, "acquire", name, holder="h3", ttl=HOUR) == (
        errno.EBUSY, f"pool {name!r}: no ready execution (2 leased, 0 quarantined)")
    assert failure(ramet, "acquire", "modes-none", holder="h3", ttl=HOUR) == (
        errno.ENOENT, "no pool 'modes-none'")
    for line in ("renew", "return"):
        options = {"ttl": HOUR} if line == "renew" else {}
        assert failure(ramet, line, a, holder="h2", **options) == (
            errno.EBUSY, f"execution {a!r} is leased by h1 (pid 42 on box)")
    assert failure(ramet, "release", a) == (
        errno.EBUSY, f"execution {a!r} is leased by h1; release it with return, or drop its "
                     "pool")
    command(ramet, "return", b, holder="h2")
    for line in ("renew", "return"):
        options = {"ttl": HOUR} if line == "renew" else {}
        assert failure(ramet, line, b, holder="h2", **options) == (
            errno.EINVAL, f"execution {b!r} is not leased (state ready; an expired lease "
                          "returns it to its pool)")
    outsider = ramet.create(base)
    assert failure(ramet, "renew", outsider.id, holder="h", ttl=HOUR) == (
        errno.ENOENT, f"execution {outsider.id!r} is not in a pool")
    ramet.release(outsider)
    assert failure(ramet, "return", a, holder="h1", verify="shallow") == (
        errno.EINVAL, "verification mode must be one of root, deep, not 'shallow'")
    assert member(ramet, a)["state"] == "leased"  # the bad return changed nothing
    command(ramet, "drop", name)
    assert failure(ramet, "drop", name) == (errno.ENOENT, f"no pool {name!r}")


def test_release_takes_a_member_out_of_its_pool(ramet, source):
    base = ramet.snapshot(source)
    name, (a, b, c) = new_pool(ramet, base, 3)
    ramet.release(a)
    assert (pool_record(ramet, name)["size"], pool_record(ramet, name)["executions"]) == (
        2, [b, c])
    # An ended lease holds nothing: release takes the member (in FUSE mode whether or not
    # the lease task has returned it by then).
    ended = command(ramet, "acquire", name, holder="gone", ttl="0")["execution"]
    ramet.release(ended)
    record = pool_record(ramet, name)
    assert (record["size"], record["executions"]) == (1, sorted({b, c} - {ended}))
    assert ended not in {e["id"] for e in ramet.executions()}
    command(ramet, "drop", name)


@pytest.mark.allow_log(QUARANTINE_LOG)
def test_a_ready_member_that_differs_is_quarantined_and_replaced(ramet, source):
    base = ramet.snapshot(source)
    name, members = new_pool(ramet, base, 2)
    victim = members[0]
    (ramet.execution(victim).path / "junk").write_text("left behind\n")  # a zombie writer
    # Deep: fallback mode's quick verification also names the root ("M /"), whose mtime
    # its manifest vouched for.
    assert ramet.execution(victim).verify(deep=True) == [("A", "junk")]
    reason = "deep verification: differs from its base (A junk)"
    assert member(ramet, victim) == {"pool": name, "state": "quarantined", "lease": None,
                                     "quarantine_reason": reason}
    record = pool_record(ramet, name)
    assert (record["size"], record["ready"], record["leased"], record["quarantined"]) == (
        2, 2, 0, 1)
    replacement, = set(record["executions"]) - set(members)
    assert re.fullmatch(MEMBER.format(pool=name), replacement)
    held = {command(ramet, "acquire", name, holder=f"h{i}", ttl=HOUR)["execution"]
            for i in (1, 2)}
    assert held == {members[1], replacement}
    assert failure(ramet, "acquire", name, holder="h3", ttl=HOUR) == (
        errno.EBUSY, f"pool {name!r}: no ready execution (2 leased, 1 quarantined)")
    ramet.release(victim)  # kept for inspection until released; the pool keeps its size
    assert pool_record(ramet, name)["size"] == 2
    command(ramet, "drop", name)
