"""A restore reads the agent's tree as root, but never follows a path the agent planted.

A hostile-agent pass found that a restore hashed a recipe's inputs by path, following any
symlink on the way: an earlier recipe's command (the agent's) could point a later recipe's
input at another execution's 0700 file, and the error printed a prefix of that file's
BLAKE3.  Here the agent's recipes run in real bubblewrap as uid 65534 and the harness
(root) restores, through a daemon of this module served with ``--allow-other`` and in
fallback mode: a symlink on an input's way makes it missing, a symlink that is the input
is hashed as a link, a FIFO is never opened (a concurrent process swapping one in for the
input cannot hang the check either), an input past ``MAX_INPUT_BYTES`` is refused before
it is read, and no message holds a digest of bytes outside the agent's tree.  A symlink
planted before the promote stops the promote in both modes.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
from pathlib import Path

import blake3
import pytest

from conftest import require_bwrap
from rametfs import Ramet, RametError, restore
from rametfs.core import policy
from rametfs.client import RestoreError
from rametfs.sandbox import Bubblewrap
from test_import_safety import RACE_HITS, attacker, bounded, exchange, give_to_nobody
from test_snapshots import write_tree

PUBLIC = b'{"name": "the-agents-own-package"}\n'
SECRET = b'{"name": "the victim\'s package", "token": "' + os.urandom(8).hex().encode() + b'"}\n'
EMPTY = blake3.blake3(b"").hexdigest()
# The raced check runs until RACE_HITS checks saw the swap between listing and opening the
# input, at most RACE_CHECKS times: on this 2-core machine 1 check in 80 did in fallback mode
# (0.1 ms each), and most checks through the mount.
RACE_CHECKS = 20_000


def digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def recipes(web_input: str) -> str:
    """The harness's policy of the issue: ``build`` runs the agent's ``build.sh``, then
    ``web`` checks ``web_input`` before it runs."""
    return ('[rebuildable.build]\npaths = ["build/"]\ninputs = ["build.sh"]\n'
            'command = "sh build.sh"\n\n'
            f'[rebuildable.web]\npaths = ["web/node_modules/"]\ninputs = ["{web_input}"]\n'
            'command = "mkdir -p web/node_modules"\n')


@pytest.fixture(params=["fuse", "fallback"])
def ramet(request, tmp_path):
    """The wrapper in each mode: on the module's ``--allow-other`` daemon (the sandbox's uid
    must enter the mount), or in fallback mode on a data directory of the test's own."""
    require_bwrap()
    if request.param == "fuse":
        yield Ramet(request.getfixturevalue("allow_other_daemon").mnt)
    else:
        with Ramet(data=tmp_path / "data", mode="fallback") as r:
            yield r


@pytest.fixture
def victim(ramet, tmp_path):
    """Another execution (the daemon's, share 0700) holding ``web/src/package.json`` =
    :data:`SECRET`."""
    ex = ramet.create(ramet.snapshot(write_tree(tmp_path / "victim",
                                                {"web/src/package.json": SECRET})))
    assert ex.status()["share"] == "0700"
    yield ex
    ramet.release(ex)


def victims_digests(victim) -> list[str]:
    """What hashing the victim's bytes gives: its file, its ``web/src`` and ``web``."""
    src = policy.tree_digest([(b"package.json", "f", digest(SECRET))])
    web = policy.tree_digest([(b"src", "d", "-"), (b"src/package.json", "f", digest(SECRET))])
    assert digest(SECRET) == blake3.blake3((victim.path / "web/src/package.json")
                                           .read_bytes()).hexdigest()
    return [digest(SECRET), src, web]


def promoted(ramet: Ramet, tmp_path: Path, web_input: str, build_sh: str) -> str:
    """The agent's execution, its tree 65534's (``build.sh``, ``web/src/package.json`` =
    :data:`PUBLIC`, the recipes' outputs), promoted under the harness's policy
    (:func:`recipes`); the snapshot id."""
    src = write_tree(tmp_path / "agent", {"build.sh": build_sh.encode(),
                                          "web/src/package.json": PUBLIC, "build/out": b"o",
                                          "web/node_modules/m": b"m"})
    give_to_nobody(src)
    (tmp_path / "policy.toml").write_text(recipes(web_input))
    ex = ramet.create(ramet.snapshot(src), policy=tmp_path / "policy.toml")
    try:
        sid = ex.promote()
    finally:
        ramet.release(ex)
    record = next(s for s in ramet.snapshots() if s["id"] == sid)
    assert [r["name"] for r in record["recipes"]] == ["build", "web"]
    return sid


def failed_restore(ramet: Ramet, sid: str, unblock=lambda: None) -> RestoreError:
    """Restore ``sid`` with bubblewrap (within the import tests' time bound); its error,
    after checking that ``build`` ran and ``web``'s inputs failed, and releasing it."""
    with pytest.raises(RestoreError) as info:
        bounded(lambda: ramet.restore(sid, runtime="bubblewrap"), unblock)
    err = info.value
    ramet.release(err.execution)
    assert [(s.recipe, s.step, s.ok) for s in err.steps] == [
        ("build", "inputs", True), ("build", "command", True), ("web", "inputs", False)], err
    assert str(err).endswith(f"recipe web: inputs failed: {err.steps[-1].detail}")
    return err


# ----- a symlink planted by an earlier recipe ----------------------------------------------------

@pytest.mark.parametrize("plant", ["input's directory", "first directory", "input itself",
                                   "inside a directory input"])
def test_an_earlier_recipe_cannot_point_a_later_input_at_another_execution(
        ramet, tmp_path, victim, plant):
    """The issue's repro: ``build.sh`` replaces ``web/src`` by a symlink to the victim's.
    Today's code hashed the victim's 0700 file as root and printed its digest's prefix."""
    theirs = f"{victim.path}/web"
    web_input, build_sh, detail = {
        "input's directory": (
            "web/src/package.json", f"rm -rf web/src && ln -s {theirs}/src web/src\n",
            "input web/src/package.json is missing: web/src is a symlink, which is not "
            "followed"),
        "first directory": (
            "web/src", f"rm -rf web && ln -s {theirs} web\n",
            "input web/src is missing: web is a symlink, which is not followed"),
        "input itself": (  # hashed as a link: the target is the agent's own bytes
            "web/src/package.json",
            f"rm web/src/package.json && ln -s {theirs}/src/package.json web/src/package.json\n",
            f"input web/src/package.json changed (BLAKE3 "
            f"{digest(f'{theirs}/src/package.json'.encode())[:16]}..., recorded "
            f"{digest(PUBLIC)[:16]}...)"),
        "inside a directory input": (
            "web/src", f"ln -s {theirs}/src web/src/lib\n",
            f"input web/src changed (BLAKE3 " + policy.tree_digest([
                (b"package.json", "f", digest(PUBLIC)),
                (b"lib", "l", digest(f"{theirs}/src".encode()))])[:16] + "..., recorded "
            + policy.tree_digest([(b"package.json", "f", digest(PUBLIC))])[:16] + "...)"),
    }[plant]
    err = failed_restore(ramet, promoted(ramet, tmp_path, web_input, build_sh))
    for theirs_digest in victims_digests(victim):
        assert theirs_digest[:16] not in str(err)
    assert (err.errno, err.steps[-1].errno, err.steps[-1].detail) == (errno.EIO, errno.EIO,
                                                                      detail)


def test_a_symlink_planted_before_the_promote_stops_the_promote(ramet, tmp_path, victim):
    """The agent points ``web/src`` at the victim's before the harness promotes.  FUSE mode
    already found the input missing; fallback mode followed the symlink and recorded the
    digest of the victim's 0700 file in the snapshot."""
    src = write_tree(tmp_path / "agent", {"web/src/package.json": PUBLIC,
                                          "web/node_modules/m": b"m"})
    give_to_nobody(src)
    (tmp_path / "policy.toml").write_text(recipes("web/src/package.json"))
    ex = ramet.create(ramet.snapshot(src), policy=tmp_path / "policy.toml")
    try:
        plant = f"rm -rf web/src && ln -s {victim.path}/web/src web/src"
        assert Bubblewrap().run(ex, ["sh", "-c", plant], timeout=30).ok
        before = ramet.snapshots()
        with pytest.raises(RametError) as info:
            ex.promote()
        assert (info.value.errno, str(info.value)) == (errno.EINVAL, (
            "promote stopped by the policy (create --policy): recipe web: input "
            "web/src/package.json is missing"))
        assert ramet.snapshots() == before
    finally:
        ramet.release(ex)


# ----- FIFOs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("web_input", ["web/src/package.json", "web/src"])
def test_a_fifo_as_an_input_is_never_opened(ramet, tmp_path, web_input):
    """``build.sh`` makes the input (or an entry of the directory input) a FIFO: hashed as
    "other" (no bytes), never opened.  Today's code also never opened one there: this
    guards the rule (the raced test below is the one it failed)."""
    build_sh = "rm web/src/package.json && mkfifo web/src/package.json\n"
    if web_input == "web/src":
        actual = policy.tree_digest([(b"package.json", "o", "-")])
        recorded = policy.tree_digest([(b"package.json", "f", digest(PUBLIC))])
    else:
        actual, recorded = EMPTY, digest(PUBLIC)
    sid = promoted(ramet, tmp_path, web_input, build_sh)

    def unblock() -> None:  # a check stuck opening the FIFO: give it a writer, so EOF
        for record in ramet.executions():
            with contextlib.suppress(OSError):
                path = ramet.execution(record["id"]).path / "web/src/package.json"
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    err = failed_restore(ramet, sid, unblock)
    assert (err.errno, err.steps[-1].detail) == (errno.EIO, (
        f"input {web_input} changed (BLAKE3 {actual[:16]}..., recorded {recorded[:16]}...)"))


def test_a_fifo_swapped_in_for_an_input_cannot_hang_the_check(ramet, tmp_path):
    """A process of the agent's uid (65534, forked by the test: any process of that uid that
    reaches the tree, such as one a ``host`` runtime left behind) swaps the input
    ``web/src/package.json`` and a FIFO for ever while the harness checks it
    (rametfs.restore.rebuild, as ``Ramet.restore`` calls it).  Today's code saw a regular
    file, then opened the FIFO by path and blocked; now each check ends at once: the file's
    digest, the FIFO's (none), or "changed while it was hashed"."""
    src = write_tree(tmp_path / "agent", {"web/src/package.json": PUBLIC})
    os.mkfifo(src / "web/src/p")
    give_to_nobody(src)
    ex = ramet.create(ramet.snapshot(src))
    # Recorded as something else, so that no check passes and no command needs to run.
    recipe = {"name": "web", "outputs": ["web/node_modules"],
              "inputs": [{"path": "web/src/package.json", "blake3": digest(b"other")}],
              "command": ["mkdir", "-p", "web/node_modules"], "check": None, "timeout": 30.0}
    here = ex.path / "web" / "src"
    changed = "input web/src/package.json changed "
    recorded = f"recorded {digest(b'other')[:16]}...)"
    raced = (f"{changed}while it was hashed: web/src/package.json is another file than the "
             "one listed")
    outcomes = {f"{changed}(BLAKE3 {digest(PUBLIC)[:16]}..., {recorded}",
                f"{changed}(BLAKE3 {EMPTY[:16]}..., {recorded}", raced}
    seen: collections.Counter = collections.Counter()

    def unblock() -> None:
        for name in ("package.json", "p"):
            with contextlib.suppress(OSError):
                os.close(os.open(here / name, os.O_WRONLY | os.O_NONBLOCK))

    try:
        with attacker(here, exchange("package.json", "p")):
            for _ in range(RACE_CHECKS):
                steps = bounded(lambda: restore.rebuild(ex, [recipe], Bubblewrap().run),
                                unblock)
                assert [(s.step, s.ok, s.errno) for s in steps] == [
                    ("inputs", False, errno.EIO)]
                seen[steps[0].detail] += 1
                if seen[raced] >= RACE_HITS:
                    break
        assert set(seen) <= outcomes and seen[raced], seen  # the race was run, and met
    finally:
        ramet.release(ex)


# ----- size --------------------------------------------------------------------------------

@pytest.mark.parametrize("web_input", ["web/src/package.json", "web/src"])
def test_an_input_past_the_limit_is_refused_before_it_is_read(ramet, tmp_path, web_input):
    """``build.sh`` makes the input a 2 GiB sparse file (or two of 600 MiB in the directory
    input): refused with EFBIG at once.  Today's code hashed every byte of the holes."""
    build_sh = ("truncate -s 2G web/src/package.json\n" if web_input != "web/src" else
                "truncate -s 600M web/src/package.json web/src/more\n")
    err = failed_restore(ramet, promoted(ramet, tmp_path, web_input, build_sh))
    step = err.steps[-1]
    assert (err.errno, step.errno, step.seconds < 1.0) == (errno.EFBIG, errno.EFBIG, True), step
    assert step.detail == f"input {web_input} holds more than {policy.MAX_INPUT_BYTES} bytes"
