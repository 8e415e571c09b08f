"""The pool and lease state machine (rametfs.core.pools) on its own: no mount, no daemon, no
sleeping.  The time is an argument, so leases end exactly when a test says; every reply and
message is compared whole.  Both modes drive these rules (tests/test_pool_modes.py runs the
client's pool API on each)."""

from __future__ import annotations

import errno
import re

import pytest

from rametfs.authority import DAEMON_GID, DAEMON_UID, Access
from rametfs.core import pools as core
from rametfs.core import status
from rametfs.errors import (Busy, Cancelled, Exists, IntegrityError, InvalidArgument, NoSpace,
                            NotFound)
from rametfs import protocol
from rametfs.protocol import ProtocolError
from rametfs.protocol import Access as Options
from rametfs.store.catalog import Lease, Member

BASE, OTHER = "ab" * 32, "cd" * 32
POLICY = {"from": "pool", "text": "[keep]\n"}
S = 1_000_000_000  # ns
T0 = 1_700_000_000 * S  # a wall-clock time


@pytest.fixture
def pools(store) -> core.Pools:
    return core.Pools(store)


def made(pools: core.Pools, opened: core.Opened, now_ns: int = T0) -> list[str]:
    """Record every member ``opened`` asks for, as a driver does once it made them."""
    for new in opened.new:
        assert pools.add_member(new, now_ns)
    return [new.execution for new in opened.new]


def pool_of(pools: core.Pools, size: int = 2, name: str = "p", **options) -> list[str]:
    return made(pools, pools.open(name, BASE, size, Options(**options), None, T0))


def caught(call) -> tuple[type, int, str]:
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), info.value.errno, str(info.value)


# -- open, members, drop ---------------------------------------------------------------------

def test_open_makes_a_pool_and_asks_for_its_members(pools):
    opened = pools.open("p", BASE, 2, Options(share=0o750), POLICY, T0)
    access = Access(share=0o750)
    assert (opened.pool, opened.base, opened.size, opened.created) == ("p", BASE, 2, True)
    assert [(n.pool, n.base, n.access, n.policy) for n in opened.new] == [
        ("p", BASE, access, POLICY)] * 2
    assert all(re.fullmatch(r"p-[0-9a-f]{8}", n.execution) for n in opened.new)
    assert pools.opened_reply(opened) == {"ok": True, "pool": "p", "snapshot": BASE, "size": 2,
                                          "created": True, "executions": []}
    members = made(pools, opened, T0 + 5)
    assert pools.opened_reply(opened)["executions"] == sorted(members)
    assert pools.to_json() == [{
        "name": "p", "base": BASE, "size": 2, "created_ns": T0, "keep_last": None,
        "executions": sorted(members), "ready": 2, "leased": 0, "quarantined": 0,
        "owner": DAEMON_UID, "group": DAEMON_GID, "share": "0750", "control": "full",
        "max_bytes": None, "max_inodes": None}]
    assert pools.member_json(members[0]) == {"pool": "p", "state": "ready", "lease": None,
                                             "quarantine_reason": None}
    assert pools.member_json("elsewhere") == {"pool": None, "state": "ready", "lease": None,
                                              "quarantine_reason": None}


def test_an_unnamed_pool_gets_a_name_and_bad_names_and_sizes_are_einval(pools):
    assert re.fullmatch(r"pool-[0-9a-f]{8}", pools.open(None, BASE, 1, Options(), None, T0).pool)
    for name, size, message in [  # the pool command's checks (rametfs.protocol.Pool)
            ("p", 0, "--size must be a whole number >= 1, not '0'"),
            ("p", 4097, "pool size must be 1 to 4096, not 4097"),
            ("bad/name", 1, "pool name 'bad/name' must match [A-Za-z0-9][A-Za-z0-9._-]{0,47}")]:
        with pytest.raises(ProtocolError) as info:
            protocol.Pool(BASE, size, name)
        assert (info.value.errno, str(info.value)) == (errno.EINVAL, message)
    assert caught(lambda: Options(share=0o644)) == (
        InvalidArgument, errno.EINVAL, "--share must be octal permission bits that give the "
        "owner rwx (0700 to 0777), not '0644'")
    assert len(pools.to_json()) == 1


def test_reattaching_grows_never_shrinks_and_checks_base_settings_and_policy(pools):
    first = made(pools, pools.open("p", BASE, 2, Options(control="read"), POLICY, T0))
    again = pools.open("p", BASE, 1, Options(), None, T0 + S)  # neither options nor policy: fine
    assert (again.size, again.created, again.new) == (2, False, ())
    grown = pools.open("p", BASE, 3, Options(control="read"), POLICY, T0 + S)
    assert (grown.size, grown.created, len(grown.new)) == (3, False, 1)
    assert grown.new[0].access == Access(control="read")
    made(pools, grown)
    assert pools.to_json()[0]["created_ns"] == T0 and len(pools.to_json()[0]["executions"]) == 3
    ids = f"owner {DAEMON_UID}, group {DAEMON_GID}, share 0700"
    for base, options, policy, message in [
            (OTHER, Options(), None, f"pool 'p' exists with base {BASE}, not {OTHER}"),
            (BASE, Options(control="full"), None,
             f"pool 'p' exists with {ids}, control read, max_bytes None, max_inodes None, "
             f"not {ids}, control full, max_bytes None, max_inodes None"),
            (BASE, Options(), {"from": "pool", "text": "[other]\n"},
             "pool 'p' exists with another persistence policy")]:
        assert caught(lambda: pools.open("p", base, 2, options, policy, T0)) == (
            Exists, errno.EEXIST, message)
    assert pools.to_json()[0]["size"] == 3 and sorted(first) == sorted(
        set(pools.to_json()[0]["executions"]) - {grown.new[0].execution})


def test_a_member_the_pool_no_longer_wants_is_refused(pools):
    opened = pools.open("p", BASE, 1, Options(), None, T0)
    spare = pools.open("p", BASE, 1, Options(), None, T0)  # another process, meanwhile
    assert pools.add_member(opened.new[0], T0)
    assert not pools.add_member(spare.new[0], T0)  # the pool serves its size already
    assert pools.drop("p") == {"ok": True, "pool": "p", "executions": [opened.new[0].execution]}
    assert not pools.add_member(opened.new[0], T0)  # dropped
    remade = pools.open("p", OTHER, 1, Options(), None, T0)
    assert not pools.add_member(opened.new[0], T0)  # made again, of another base
    assert pools.add_member(remade.new[0], T0)


def test_drop_forgets_the_pool_and_its_members(pools):
    members = pool_of(pools, 2)
    pools.acquire("p", "h", 1, "host", 60 * S, T0)
    assert pools.drop("p") == {"ok": True, "pool": "p", "executions": sorted(members)}
    assert (pools.to_json(), pools.member_json(members[0])["pool"]) == ([], None)
    assert caught(lambda: pools.drop("p")) == (NotFound, errno.ENOENT, "no pool 'p'")
    assert pools.expired(T0 + 3600 * S) == []


def test_prune_forgets_members_without_a_pool_or_an_execution(pools, store):
    kept, gone = pool_of(pools, 2)
    with store.write() as txn:  # a member of a pool that is no more
        pools.catalog.put_member(txn, Member("orphan-1", "nopool"))
    assert pools.prune(lambda eid: eid != gone) == sorted([gone, "orphan-1"])
    assert pools.to_json()[0]["executions"] == [kept]


# -- leases ----------------------------------------------------------------------------------

def test_acquire_hands_out_the_last_returned_and_says_why_none_is_free(pools):
    a, b = pool_of(pools, 2)
    got = pools.acquire("p", "h1", 42, "box", 10 * S, T0)
    first = got.member.execution
    assert (got.base, got.taken_over, got.member.state) == (BASE, False, "leased")
    assert got.member.lease == Lease("h1", 42, "box", T0 + 10 * S, T0)
    assert pools.acquired_reply(got, "/where") == {
        "ok": True, "execution": first, "pool": "p", "snapshot": BASE, "path": "/where",
        "lease": {"holder": "h1", "pid": 42, "host": "box", "expires_ns": T0 + 10 * S,
                  "acquired_ns": T0}}
    second = pools.acquire("p", "h2", 0, "", 10 * S, T0).member.execution
    assert {first, second} == {a, b}
    assert caught(lambda: pools.acquire("p", "h3", 0, "", S, T0)) == (
        Busy, errno.EBUSY, "pool 'p': no ready execution (2 leased, 0 quarantined)")
    assert caught(lambda: pools.acquire("q", "h3", 0, "", S, T0)) == (
        NotFound, errno.ENOENT, "no pool 'q'")
    pools.returned(first, "h1", "", T0 + 2 * S)
    pools.returned(second, "h2", "", T0 + 3 * S)
    assert pools.acquire("p", "h", 0, "", S, T0 + 4 * S).member.execution == second
    assert pools.acquire("p", "h", 0, "", S, T0 + 4 * S).member.execution == first


def test_an_ended_lease_is_taken_over_only_when_asked_and_ready_ones_go_first(pools):
    pool_of(pools, 3)
    leased = {pools.acquire("p", f"h{i}", 0, "", ttl * S, T0).member.execution: ttl
              for i, ttl in enumerate((5, 3, 9))}
    by_ttl = sorted(leased, key=leased.get)
    assert [m.execution for m in pools.expired(T0 + 5 * S)] == by_ttl[:2]
    now = T0 + 6 * S
    assert caught(lambda: pools.acquire("p", "new", 0, "", S, now)) == (
        Busy, errno.EBUSY, "pool 'p': no ready execution (3 leased, 0 quarantined)")
    got = pools.acquire("p", "new", 7, "", S, now, take_expired=True)
    assert (got.member.execution, got.taken_over) == (by_ttl[0], True)
    assert got.member.lease == Lease("new", 7, "", now + S, now)
    assert pools.held(by_ttl[0], "new") == got.member
    # A ready member goes before an ended lease.
    five = by_ttl[1]
    pools.returned(five, "h0", "", now)
    got = pools.acquire("p", "other", 0, "", S, now, take_expired=True)
    assert (got.member.execution, got.taken_over) == (five, False)


def test_held_says_whether_and_by_whom_an_execution_is_leased(pools):
    a, b = pool_of(pools, 2)
    leased = pools.acquire("p", "h1", 42, "box", 10 * S, T0).member.execution
    ready = ({a, b} - {leased}).pop()
    assert caught(lambda: pools.held("nope", "h1")) == (
        NotFound, errno.ENOENT, "execution 'nope' is not in a pool")
    assert caught(lambda: pools.held(ready, "h1")) == (
        InvalidArgument, errno.EINVAL, f"execution {ready!r} is not leased (state ready; "
        "an expired lease returns it to its pool)")
    assert caught(lambda: pools.held(leased, "h2")) == (
        Busy, errno.EBUSY, f"execution {leased!r} is leased by h1 (pid 42 on box)")
    assert pools.held(leased, "h1").lease.holder == "h1"
    assert pools.lease(leased) == Lease("h1", 42, "box", T0 + 10 * S, T0)
    assert (pools.lease(ready), pools.lease("nope")) == (None, None)


def test_renew_extends_from_now_until_the_lease_has_ended(pools):
    eid, = pool_of(pools, 1)
    pools.acquire("p", "h", 1, "x", 10 * S, T0)
    assert pools.renew(eid, "h", 30 * S, T0 + 9 * S) == {
        "ok": True, "execution": eid,
        "lease": {"holder": "h", "pid": 1, "host": "x", "expires_ns": T0 + 39 * S,
                  "acquired_ns": T0}}
    assert pools.next_expiry() == T0 + 39 * S
    # The end is exclusive: at expires_ns the lease has ended.
    assert caught(lambda: pools.renew(eid, "h", 30 * S, T0 + 39 * S)) == (
        InvalidArgument, errno.EINVAL, f"the lease on execution {eid!r} has ended")
    assert caught(lambda: pools.renew(eid, "someone", 30 * S, T0)) == (
        Busy, errno.EBUSY, f"execution {eid!r} is leased by h (pid 1 on x)")
    assert pools.lease(eid).expires_ns == T0 + 39 * S  # the failed renewals changed nothing


def test_next_expiry_after_a_time_skips_the_leases_ended_by_then(pools):
    pool_of(pools, 3)
    assert pools.next_expiry() is None
    for ttl in (5, 3, 9):
        pools.acquire("p", "h", 0, "", ttl * S, T0)
    assert pools.next_expiry() == T0 + 3 * S
    assert pools.next_expiry(after_ns=T0 + 3 * S) == T0 + 5 * S
    assert pools.next_expiry(after_ns=T0 + 9 * S) is None
    assert [m.lease.expires_ns for m in pools.expired(T0 + 9 * S)] == [
        T0 + 3 * S, T0 + 5 * S, T0 + 9 * S]
    assert pools.expired(T0 + 3 * S - 1) == []


# -- return, verification, quarantine --------------------------------------------------------

def test_a_returned_member_is_ready_again_and_a_second_return_is_refused(pools):
    pool_of(pools, 1)
    eid = pools.acquire("p", "h", 0, "", 10 * S, T0).member.execution
    settled = pools.returned(eid, "h", "", T0 + S)
    assert settled == core.Settled(eid, "p", "ready")
    assert core.return_reply(settled, 1.5, None) == {
        "ok": True, "execution": eid, "pool": "p", "state": "ready", "reset_ms": 1.5,
        "verification": None}
    assert pools.member_json(eid) == {"pool": "p", "state": "ready", "lease": None,
                                      "quarantine_reason": None}
    assert caught(lambda: pools.returned(eid, "h", "", T0 + S)) == (
        InvalidArgument, errno.EINVAL, f"execution {eid!r} is not leased (state ready; "
        "an expired lease returns it to its pool)")


def test_a_return_after_another_holder_took_over_changes_nothing(pools):
    pool_of(pools, 1)
    eid = pools.acquire("p", "slow", 0, "", S, T0).member.execution
    pools.acquire("p", "next", 0, "", 10 * S, T0 + 2 * S, take_expired=True)
    for reason in ("", "root verification: differs from its base (A x)"):
        assert caught(lambda: pools.returned(eid, "slow", reason, T0 + 3 * S)) == (
            Busy, errno.EBUSY, f"execution {eid!r} is leased by next (pid 0 on )")
    assert pools.held(eid, "next").state == "leased"


def test_a_member_failing_verification_is_quarantined_and_replaced(pools):
    pool_of(pools, 2)
    eid = pools.acquire("p", "h", 0, "", 10 * S, T0).member.execution
    reason = "root verification: differs from its base (A junk)"
    settled = pools.returned(eid, "h", reason, T0 + S)
    assert (settled.execution, settled.pool, settled.state) == (eid, "p", "quarantined")
    replacement, = settled.new
    assert (replacement.pool, replacement.base, replacement.access, replacement.policy) == (
        "p", BASE, Access(), None)
    assert pools.member_json(eid) == {"pool": "p", "state": "quarantined", "lease": None,
                                      "quarantine_reason": reason}
    assert pools.add_member(replacement, T0 + S)
    record, = pools.to_json()
    assert (record["size"], record["ready"], record["leased"], record["quarantined"]) == (
        2, 2, 0, 1)
    # Never handed out again.
    got = {pools.acquire("p", f"h{i}", 0, "", S, T0 + 2 * S).member.execution for i in (1, 2)}
    assert eid not in got
    assert caught(lambda: pools.acquire("p", "h3", 0, "", S, T0 + 2 * S)) == (
        Busy, errno.EBUSY, "pool 'p': no ready execution (2 leased, 1 quarantined)")
    # Taking over ended leases takes the two leased ones, never the quarantined one.
    taken = {pools.acquire("p", f"h{i}", 0, "", S, T0 + 9 * S, take_expired=True
                           ).member.execution for i in (4, 5)}
    assert taken == got
    assert caught(lambda: pools.acquire("p", "h6", 0, "", S, T0 + 9 * S,
                                        take_expired=True))[0] is Busy


def test_an_explicit_verification_quarantines_a_ready_member_only(pools):
    a, b = pool_of(pools, 2)
    leased = pools.acquire("p", "h", 0, "", 10 * S, T0).member.execution
    ready = ({a, b} - {leased}).pop()
    reason = "deep verification: differs from its base (M README)"
    assert pools.verified(ready, "") is None  # equal
    assert pools.verified(leased, reason) is None  # a leased member may differ
    assert pools.verified("nope", reason) is None
    assert pools.member_json(leased)["state"] == "leased"
    settled = pools.verified(ready, reason)
    assert (settled.state, len(settled.new)) == ("quarantined", 1)
    assert pools.verified(ready, reason) is None  # already quarantined: nothing again
    assert pools.member_json(ready)["quarantine_reason"] == reason


def test_quarantine_reasons_name_five_differences_quoted_as_diff_does():
    differences = [("A", b"new file"), ("M", b"caf\xc3\xa9"), ("D", b"a\nb"),
                   ("M", b"x"), ("M", b"y"), ("M", b"z"), ("A", b"\xff")]
    verification = status.verification_json("deep", "11" * 32, "22" * 32, differences, 2.5)
    assert verification == {
        "mode": "deep", "equal": False, "root": "11" * 32, "base_root": "22" * 32,
        "verify_ms": 2.5,
        "differences": [["A", "new file"], ["M", "café"], ["D", "a\nb"], ["M", "x"],
                        ["M", "y"], ["M", "z"], ["A", "\udcff"]]}
    assert status.quarantine_reason(verification) == (
        'deep verification: differs from its base (A "new file", M "caf\\303\\251", '
        'D "a\\nb", M x, M y and 2 more)')
    assert status.quarantine_reason(status.verification_json("root", "1", "1", [], 0.1)) == ""
    assert status.failure_reason("root", IntegrityError("chunk 00ff is corrupt")) == (
        "root verification failed: chunk 00ff is corrupt")
    verdicts = [IntegrityError("chunk 00ff is corrupt"), OSError(errno.EIO, "read"),
                Cancelled("return cancelled"), Busy("busy"), NoSpace("full")]
    assert [core.verification_failed(exc) for exc in verdicts] == [
        True, True, False, False, False]


# -- release ---------------------------------------------------------------------------------

def test_release_of_a_member_shrinks_its_pool_unless_a_lease_on_it_runs(pools):
    a, b, c = pool_of(pools, 3)
    leased = pools.acquire("p", "h", 0, "", 10 * S, T0).member.execution
    assert caught(lambda: pools.forget(leased, T0 + 10 * S - 1)) == (
        Busy, errno.EBUSY, f"execution {leased!r} is leased by h; release it with return, "
        "or drop its pool")
    # Chosen for both modes: a lease that has ended holds nothing (the daemon used to refuse
    # it until its lease task had returned the execution).
    pools.forget(leased, T0 + 10 * S)
    assert (pools.member_json(leased)["pool"], pools.to_json()[0]["size"]) == (None, 2)
    ready = sorted({a, b, c} - {leased})
    pools.forget(ready[0], T0)
    assert pools.to_json()[0]["size"] == 1
    pools.forget("not-a-member", T0)
    assert pools.to_json()[0]["executions"] == [ready[1]]


def test_release_of_a_quarantined_member_keeps_the_pools_size(pools):
    pool_of(pools, 1)
    eid = pools.acquire("p", "h", 0, "", S, T0).member.execution
    made(pools, pools.returned(eid, "h", "root verification failed: gone", T0))
    pools.forget(eid, T0)
    record, = pools.to_json()
    assert (record["size"], record["ready"], record["quarantined"]) == (1, 1, 0)


def test_the_state_is_the_stores_alone(pools, store):
    """Nothing is kept in memory between calls: a second Pools on the store (another
    process in fallback mode, a restarted daemon) carries on where the first left off."""
    eid, = pool_of(pools, 1)
    pools.acquire("p", "h", 3, "x", 10 * S, T0)
    other = core.Pools(store)
    assert other.held(eid, "h").lease == Lease("h", 3, "x", T0 + 10 * S, T0)
    other.returned(eid, "h", "", T0 + S)
    assert pools.member_json(eid)["state"] == "ready"
    assert pools.to_json() == other.to_json()
