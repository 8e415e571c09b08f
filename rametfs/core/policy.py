"""Persistence policies: which paths a promote keeps, by class (docs/policy.md).

A policy is a TOML file (``ramet.toml`` at the root of the tree, or given at promote) that
assigns paths by glob to a class:

* ``durable``: kept (the default for a path no pattern names);
* ``rebuildable``: not kept; its recipe is (command, inputs and their BLAKE3 hashes,
  readiness check), so a restore can build it again;
* ``ephemeral``: not kept;
* ``shared``: must equal the base, and is taken from it unchanged.

Pure logic over relative paths (``str``, ``/``-separated, no leading ``/``), the same for
both modes: parsing, which policy applies (:func:`load_chosen`), and applying it to an
execution (:func:`apply_steps`: the classified paths, what a promote leaves out or takes
from the head, the problems that stop it and their text, preview totals, recipe records),
and input digests.  Each mode gives only its view of the execution: a :class:`Tree` to walk
(the daemon's nodes, fallback's directory) and a :class:`Side` (its diff against the head,
whether an input exists).  A directory of a class other than durable is handled whole, and
patterns below it do not apply.

Patterns follow gitignore's syntax without negation: ``*`` and ``?`` match within one name,
``[...]`` a class of characters, ``**`` any number of directories; a pattern with no ``/``
(but a trailing one) matches a name at any depth, any other is anchored at the root; a
trailing ``/`` matches directories only.  When patterns of several classes match one path,
the class that keeps more wins: durable, shared, rebuildable, ephemeral.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import blake3

from ..errors import InvalidArgument, RametError
from ..longpath import short
from ..nofollow import DIR_FLAGS, FILE_FLAGS, GONE, same_file
from ..treewalk import Steps, postorder, preorder, run_steps
from ..protocol import POLICY_NONE, POLICY_TREE, quote_path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

DURABLE, SHARED, REBUILDABLE, EPHEMERAL = "durable", "shared", "rebuildable", "ephemeral"
CLASSES = (DURABLE, SHARED, REBUILDABLE, EPHEMERAL)  # precedence at one path: first wins
KEPT = (DURABLE, SHARED)
POLICY_FILE = "ramet.toml"
POLICY_VERSION = 1
DEFAULT_TIMEOUT_S = 600.0
MAX_POLICY_BYTES = 64 * 1024  # of a tree's ramet.toml; a given one fits in a 64 KiB command
RECIPE_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_WILDCARDS = frozenset("*?[")
_READ_BYTES = 1 << 20


@dataclass(frozen=True)
class Pattern:
    """One glob, compiled: ``text`` as written, matched against whole relative paths."""

    text: str
    regex: re.Pattern
    dir_only: bool
    floating: bool  # no "/" inside: matches a name at any depth
    parts: tuple[str, ...]

    def may_match_below(self, parts: list[str]) -> bool:
        """Whether some path below the directory ``parts`` (components) could match."""
        if self.floating:
            return True
        for mine, theirs in zip(self.parts, parts):
            if mine == "**" or _WILDCARDS & set(mine):
                return True
            if mine != theirs:
                return False
        return len(self.parts) > len(parts)


@dataclass(frozen=True)
class RecipeSpec:
    """A rebuildable class: ``paths`` it builds (patterns), ``command`` and ``check`` argv
    (a string is run by ``sh -c``), ``inputs`` (paths relative to the tree root whose hashes
    a promote records), ``timeout`` in seconds for each of command and check."""

    name: str
    paths: tuple[Pattern, ...]
    command: tuple[str, ...]
    inputs: tuple[str, ...]
    check: tuple[str, ...] | None
    timeout: float


@dataclass(frozen=True)
class Policy:
    """A parsed policy; ``source`` names where it came from (for messages)."""

    source: str
    patterns: dict[str, tuple[Pattern, ...]]  # durable, shared, ephemeral
    recipes: dict[str, RecipeSpec]  # in file order
    every: tuple[Pattern, ...] = field(init=False)
    matchers: tuple = field(init=False)  # (class, recipe, dirs regex, files regex), by precedence

    def __post_init__(self) -> None:
        groups = [(DURABLE, None, self.patterns[DURABLE]), (SHARED, None, self.patterns[SHARED])]
        groups += [(REBUILDABLE, r.name, r.paths) for r in self.recipes.values()]
        groups.append((EPHEMERAL, None, self.patterns[EPHEMERAL]))
        object.__setattr__(self, "every", tuple(p for *_, ps in groups for p in ps))
        object.__setattr__(self, "matchers", tuple(
            (cls, recipe, _alternation(ps), _alternation([p for p in ps if not p.dir_only]))
            for cls, recipe, ps in groups if ps))

    def classify(self, path: str, is_dir: bool) -> tuple[str, str | None] | None:
        """``(class, recipe name or None)`` of the patterns naming ``path`` itself, or None
        when none does (the path takes its directory's class)."""
        for cls, recipe, dirs, files in self.matchers:
            regex = dirs if is_dir else files
            if regex is not None and regex.fullmatch(path):
                return cls, recipe
        return None

    def class_of(self, path: str, is_dir: bool, memo: dict | None = None
                 ) -> tuple[str, str | None, str]:
        """``(class, recipe, top)``: the class ``path`` ends up in, from its topmost
        directory down, and the path (``top``) that got it (``path`` itself if durable).

        ``memo`` (a dict the caller keeps across calls) holds what each directory on the way
        got, so that classifying every path of a deep tree costs one match per path, not
        one per path and level."""
        memo = {} if memo is None else memo
        parent = path.rpartition("/")[0]
        todo, d = [], parent  # the directories above ``path`` not classified yet
        while d and d not in memo:
            todo.append(d)
            d = d.rpartition("/")[0]
        for d in reversed(todo):  # from the top down: the topmost class wins
            memo[d] = memo.get(d.rpartition("/")[0]) or self._own_class(d, True)
        return memo.get(parent) or self._own_class(path, is_dir) or (DURABLE, None, path)

    def _own_class(self, path: str, is_dir: bool) -> tuple[str, str | None, str] | None:
        """``(class, recipe, path)`` when a pattern names ``path`` itself into a class other
        than durable, else None."""
        found = self.classify(path, is_dir)
        return (*found, path) if found is not None and found[0] != DURABLE else None

    def may_match_below(self, path: str) -> bool:
        """Whether a pattern could name something below directory ``path`` ("" the root);
        if not, the directory is durable whole and need not be walked."""
        parts = path.split("/") if path else []
        return any(p.may_match_below(parts) for p in self.every)


# -- parsing ---------------------------------------------------------------------------------

def load(data: bytes, source: str) -> Policy:
    """Parse a policy file's bytes; ``source`` names it in messages.

    Raises InvalidArgument (EINVAL) naming the line: not UTF-8, not TOML, an unknown key or
    class, a value of the wrong type, a bad pattern, recipe name or input path.
    """
    try:
        text = data.decode()
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise InvalidArgument(f"{source}, line {line}: not UTF-8") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = re.search(r"\(at line (\d+), column (\d+)\)", str(exc))
        line = found.group(1) if found else text.count("\n") + 1  # "(at end of document)"
        where = f", line {line}"
        raise InvalidArgument(f"{source}{where}: {str(exc).split(' (at ')[0]}") from None
    return _Parser(text, source).policy(doc)


class _Parser:
    def __init__(self, text: str, source: str):
        self.lines = text.splitlines()
        self.source = source

    def fail(self, table: tuple[str, ...], key: str | None, what: str,
             needle: str | None = None) -> InvalidArgument:
        line = self._line(table, key, needle)
        where = f", line {line}" if line else ""
        return InvalidArgument(f"{self.source}{where}: {what}")

    def _line(self, table: tuple[str, ...], key: str | None, needle: str | None) -> int | None:
        """Where ``key`` of ``table`` (or the table's header) is written; with ``needle``,
        the first line from there quoting it.  A plain scan: enough for messages."""
        current: tuple[str, ...] = ()
        found = None
        for i, line in enumerate(self.lines, 1):
            header = re.match(r"\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$", line)
            if header:
                current = tuple(p.strip().strip("\"'") for p in header.group(1).split("."))
                if key is None and current == table:
                    return i
                continue
            if found is None and key is not None and current == table and \
                    re.match(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=", line):
                found = i
            if found is not None and (needle is None or any(
                    f"{q}{needle}{q}" in line for q in "\"'")):
                return i
        return found

    def policy(self, doc: dict) -> Policy:
        patterns: dict[str, tuple[Pattern, ...]] = {}
        for key in doc:
            if key not in ("version", DURABLE, SHARED, EPHEMERAL, REBUILDABLE):
                raise self.fail((), key, f"unknown key {key!r}: expected version, durable, "
                                "shared, ephemeral or [rebuildable.NAME] tables")
        version = doc.get("version", POLICY_VERSION)
        if version != POLICY_VERSION:
            raise self.fail((), "version", f"version {version!r}: this rametfs reads "
                            f"version {POLICY_VERSION}")
        for cls in (DURABLE, SHARED, EPHEMERAL):
            patterns[cls] = self.patterns((), cls, doc.get(cls, []))
        tables = doc.get(REBUILDABLE, {})
        if not isinstance(tables, dict) or any(not isinstance(t, dict) for t in tables.values()):
            raise self.fail((), REBUILDABLE, "rebuildable: expected [rebuildable.NAME] tables")
        recipes = {name: self.recipe(name, table) for name, table in tables.items()}
        return Policy(self.source, patterns, recipes)

    def patterns(self, table: tuple[str, ...], key: str, value) -> tuple[Pattern, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(table, key, f"{key}: expected a list of glob strings")
        out = []
        for text in value:
            try:
                out.append(compile_pattern(text))
            except ValueError as exc:
                raise self.fail(table, key, f"{key}: pattern {text!r}: {exc}", text) from None
        return tuple(out)

    def recipe(self, name: str, t: dict) -> RecipeSpec:
        where = (REBUILDABLE, name)
        if not RECIPE_NAME_RE.fullmatch(name):
            raise self.fail(where, None, f"recipe name {name!r} must match "
                            f"{RECIPE_NAME_RE.pattern}")
        for key in t:
            if key not in ("paths", "command", "inputs", "check", "timeout"):
                raise self.fail(where, key, f"rebuildable.{name}: unknown key {key!r}: "
                                "expected paths, command, inputs, check, timeout")
        for key in ("paths", "command"):
            if key not in t:
                raise self.fail(where, None, f"rebuildable.{name}: {key} is missing")
        paths = self.patterns(where, "paths", t["paths"])
        if not paths:
            raise self.fail(where, "paths", f"rebuildable.{name}: paths is empty")
        inputs = t.get("inputs", [])
        if not isinstance(inputs, list) or not all(isinstance(v, str) for v in inputs):
            raise self.fail(where, "inputs", f"rebuildable.{name}: inputs: expected a list "
                            "of paths")
        for path in inputs:
            parts = path.strip("/").split("/")
            if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise self.fail(where, "inputs", f"rebuildable.{name}: input {path!r} must be "
                                "a path inside the tree, relative to its root", path)
        timeout = t.get("timeout", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise self.fail(where, "timeout", f"rebuildable.{name}: timeout must be a "
                            "positive number of seconds")
        check = self.argv(where, "check", t["check"]) if "check" in t else None
        return RecipeSpec(name, paths, self.argv(where, "command", t["command"]),
                          tuple(p.strip("/") for p in inputs), check, float(timeout))

    def argv(self, where: tuple[str, ...], key: str, value) -> tuple[str, ...]:
        if isinstance(value, str) and value.strip():
            return ("sh", "-c", value)
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise self.fail(where, key, f"rebuildable.{where[1]}: {key}: expected a command "
                        "string (run by sh -c) or a non-empty list of arguments")


def _alternation(patterns: list[Pattern]) -> re.Pattern | None:
    """One regex matching what any of ``patterns`` matches (None for none)."""
    if not patterns:
        return None
    return re.compile("|".join(f"(?:{p.regex.pattern})" for p in patterns), re.S)


def compile_pattern(text: str) -> Pattern:
    """Compile one glob (module docstring); ValueError saying what is wrong with it."""
    if text.startswith("!"):
        raise ValueError("negation ('!') is not supported: name the exception in another class")
    dir_only = text.endswith("/")
    body = text.strip("/")
    if not body:
        raise ValueError("names nothing (the root cannot be classified)")
    parts = tuple(body.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError("empty, '.' or '..' path component")
    floating = len(parts) == 1 and not text.startswith("/")
    regex = "" if not floating else "(?:.*/)?"
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if part == "**":
            regex += ".+" if last else "(?:[^/]+/)*"
        else:
            regex += _translate(part) + ("" if last else "/")
    return Pattern(text, re.compile(regex, re.S), dir_only, floating, parts)


def _translate(part: str) -> str:
    out, i = "", 0
    while i < len(part):
        c = part[i]
        if c == "*":
            while i + 1 < len(part) and part[i + 1] == "*":
                i += 1
            out += "[^/]*"
        elif c == "?":
            out += "[^/]"
        elif c == "[":
            end = part.find("]", i + 2 if part[i + 1:i + 2] in ("!", "^") else i + 1)
            if end < 0:
                raise ValueError("unclosed '['")
            inner = part[i + 1:end]
            negate = inner[:1] in ("!", "^")
            inner = inner[1:] if negate else inner
            out += "[" + ("^/" if negate else "") + inner.replace("\\", "\\\\") + "]"
            i = end
        else:
            out += re.escape(c)
        i += 1
    return out


# -- which policy applies --------------------------------------------------------------------

COMMAND, CREATE, POOL = "command", "create", "pool"  # where the harness gave a policy


@dataclass(frozen=True)
class Setting:
    """The policy the harness chose: its TOML ``text``, or (``text`` None) the tree's own
    ``ramet.toml``; ``given`` where it was given: ``"command"`` (with the promote, preview
    or checkpoint), ``"create"`` or ``"pool"`` (stored with the execution).

    Its record (the execution's ``policy`` field, docs/format.md) is ``{"from": given,
    "text": text}``.
    """

    text: str | None
    given: str = COMMAND

    @property
    def source(self) -> str:
        """What messages and ``stats.policy`` call it: ``ramet.toml``, ``--policy``,
        ``create --policy`` or ``pool --policy``."""
        if self.text is None:
            return POLICY_FILE
        return "--policy" if self.given == COMMAND else f"{self.given} --policy"

    def record(self) -> dict:
        return {"from": self.given, "text": self.text}

    @classmethod
    def from_record(cls, record: dict | None) -> Setting | None:
        return None if record is None else cls(record["text"], record["from"])


def _check_tree_file(mode: int, size: int) -> None:
    """Raise InvalidArgument (EINVAL) unless the tree's ``ramet.toml`` (``st_mode``, bytes)
    is a regular file of at most :data:`MAX_POLICY_BYTES`: a policy is read whole."""
    if not stat.S_ISREG(mode):
        raise InvalidArgument(f"{POLICY_FILE} is not a regular file")
    if size > MAX_POLICY_BYTES:
        raise InvalidArgument(f"{POLICY_FILE} is {size} bytes: a policy is at most "
                              f"{MAX_POLICY_BYTES}")


def setting(value: str, given: str = COMMAND) -> Setting | None:
    """The policy a ``--policy`` value names: None for ``none`` (no policy: everything is
    kept), the tree's ``ramet.toml`` for ``tree``, else the value as a policy's text."""
    if value == POLICY_NONE:
        return None
    return Setting(None if value == POLICY_TREE else value, given)


def stored(value: str | None, given: str) -> dict | None:
    """The record to store for the ``--policy`` value given at ``create`` or ``pool``
    (None: none), its text parsed now so that a malformed one is refused when given:
    InvalidArgument (EINVAL) naming the line."""
    chosen = None if value is None else setting(value, given)
    if chosen is None:
        return None
    if chosen.text is not None:
        load(chosen.text.encode(), chosen.source)
    return chosen.record()


def shown(record: dict | None) -> str | None:
    """What an execution's status says of its stored policy: its source (``create
    --policy``, ``pool --policy``, ``ramet.toml``) or None."""
    chosen = Setting.from_record(record)
    return None if chosen is None else chosen.source


def choose(value: str | None, stored: dict | None) -> Setting | None:
    """The policy a promote or preview applies: the ``--policy`` value given with the
    command (:func:`setting`), else the one stored with the execution (its record), else
    None.  Raises InvalidArgument (EINVAL) for a malformed value."""
    return setting(value) if value is not None else Setting.from_record(stored)


def load_chosen(chosen: Setting | None,
                tree_file: Callable[[], tuple[int, int, Callable[[], bytes]] | None]
                ) -> Policy | None:
    """The policy ``chosen``: its text parsed, or (text None, ``--policy tree``) the tree's
    ``ramet.toml``, none when it is absent; None for none.  ``tree_file()`` is how the mode
    finds that file, never following a symlink: None when absent, else ``(st_mode, size,
    read)``, ``read()`` its bytes (called only for a regular file of at most
    :data:`MAX_POLICY_BYTES`).  Raises InvalidArgument (EINVAL) naming the line of a
    malformed one, or for a ``ramet.toml`` that is not such a file."""
    if chosen is None:
        return None
    if chosen.text is not None:
        return load(chosen.text.encode(), chosen.source)
    found = tree_file()
    if found is None:
        return None
    mode, size, read = found
    _check_tree_file(mode, size)
    return load(read(), POLICY_FILE)


# -- preview ---------------------------------------------------------------------------------

class Tree(Protocol):
    """What :func:`preview` needs of a tree: items are whatever the mode walks."""

    def children(self, item) -> Iterable[tuple[bytes, object]]: ...
    def kind(self, item) -> str: ...  # "d" directory, "f" regular file, "l" symlink, "o" other
    def size(self, item) -> int: ...  # bytes of a regular file
    def totals(self, item) -> tuple[int, int]: ...  # (files, bytes) below a directory


def kind_of(mode: int) -> str:
    """``"d"`` directory, ``"f"`` regular file, ``"l"`` symlink, ``"o"`` other, of st_mode."""
    if stat.S_ISDIR(mode):
        return "d"
    return "f" if stat.S_ISREG(mode) else "l" if stat.S_ISLNK(mode) else "o"


def subtree_totals(tree: Tree, item) -> tuple[int, int]:
    """``(files, bytes)`` below directory ``item``, by walking it."""
    def children(pair: tuple[str, object]) -> list | None:
        kind, it = pair
        return [(tree.kind(c), c) for _name, c in tree.children(it)] if kind == "d" else None

    def combine(pair: tuple[str, object], below: list | None) -> tuple[int, int]:
        kind, it = pair
        if below is not None:
            return sum(f for f, _ in below), sum(b for _, b in below)
        return (1, tree.size(it)) if kind == "f" else (0, 0)

    return postorder(("d", item), children, combine)


class FsTree:
    """:class:`Tree` over a real directory: items are ``(absolute path, lstat result)``;
    paths may be longer than PATH_MAX (rametfs.longpath)."""

    @staticmethod
    def root(path: bytes) -> tuple[bytes, os.stat_result]:
        return path, os.lstat(path)

    @staticmethod
    def children(item: tuple[bytes, os.stat_result]):
        path = item[0]
        with short(path) as p, os.scandir(p) as it:
            found = sorted((e.name, e.stat(follow_symlinks=False)) for e in it)
        return [(name, (path + b"/" + name, st)) for name, st in found]

    @staticmethod
    def kind(item: tuple[bytes, os.stat_result]) -> str:
        return kind_of(item[1].st_mode)

    @staticmethod
    def size(item: tuple[bytes, os.stat_result]) -> int:
        return item[1].st_size

    def totals(self, item: tuple[bytes, os.stat_result]) -> tuple[int, int]:
        return subtree_totals(self, item)


@dataclass
class Classified:
    """The paths of a tree by class: ``durable`` lists files (not directories); the other
    classes list their topmost paths.  Each item: ``(path, kind, files, bytes, recipe)``."""

    paths: list[tuple[str, str, str, int, int, str | None]] = field(default_factory=list)
    outputs: dict[str, list[str]] = field(default_factory=dict)  # recipe -> its paths


def classify_steps(policy: Policy | None, tree: Tree, root, durable: bool = True,
                   paths: list | None = None) -> Steps[Classified]:
    """Walk ``tree`` from ``root`` and classify every path (all durable without a policy),
    as steps (rametfs.treewalk.run_steps): one per directory.  ``durable=False`` lists only
    the other classes, and skips directories where no pattern can match (what a promote
    needs).  ``paths``: the list ``Classified.paths`` is (a caller's may bound it: only its
    ``append`` is called); a new one by default."""
    out = Classified() if paths is None else Classified(paths)

    def below(item: tuple[object, str]) -> Iterator[tuple[object, str]]:
        """Classify the paths of one durable directory; yields its durable subdirectories,
        which the walk classifies before this one goes on."""
        node, prefix = item
        if not durable and not policy.may_match_below(prefix.rstrip("/")):
            return
        for name, child in tree.children(node):
            path = f"{prefix}{os.fsdecode(name)}"
            kind = tree.kind(child)
            found = policy.classify(path, kind == "d") if policy else None
            cls, recipe = found or (DURABLE, None)
            if cls == DURABLE and kind == "d":
                yield child, path + "/"
                continue
            if cls == DURABLE and not durable:
                continue
            if kind == "d":
                files, nbytes = tree.totals(child)
                path += "/"
            else:
                files, nbytes = (1, tree.size(child)) if kind == "f" else (0, 0)
            out.paths.append((path, cls, kind, files, nbytes, recipe))
            if recipe:
                out.outputs.setdefault(recipe, []).append(path.rstrip("/"))

    for _ in preorder([(root, "")], below):
        yield
    return out



# -- applying a policy to an execution (both modes) ------------------------------------------

class Side(Protocol):
    """What :func:`apply_steps` asks of an execution besides its :class:`Tree`: the daemon's
    answers from its nodes (rametfs.capture), fallback mode's from its directory and a scan
    (rametfs.fallback.executions)."""

    def changes(self, skip: frozenset[str]) -> Steps[list[tuple[str, bytes]]]:
        """The execution's diff against its head (rametfs.core.diff), as steps; the paths
        of ``skip`` (left out by the policy: none of them shared) and below them may be
        missing from it."""
        ...

    def exists(self, path: str) -> bool | None:
        """Whether the relative ``path`` (reached without following a symlink) is a
        directory; None when it is missing."""
        ...


@dataclass(frozen=True)
class Plan:
    """What ``policy`` (None: none, everything kept) makes of one execution's tree: its
    ``classified`` paths and the ``problems`` that stop a promote (changed shared paths,
    recipe inputs missing or not kept), each as the preview lists it."""

    policy: Policy | None
    classified: Classified = field(default_factory=Classified)
    problems: tuple[str, ...] = ()
    # topmost non-durable path (no trailing "/") -> its class
    special: dict[str, str] = field(init=False)
    above: frozenset[str] = field(init=False)  # the directories holding one ("" the root)

    def __post_init__(self) -> None:
        special = {path.rstrip("/"): cls for path, cls, *_ in self.classified.paths
                   if cls != DURABLE}
        above: set[str] = set()
        for path in special:
            while path not in above:  # its directories, up to one already there
                path = path.rpartition("/")[0]
                above.add(path)
        object.__setattr__(self, "special", special)
        object.__setattr__(self, "above", frozenset(above))

    @property
    def skip(self) -> frozenset[str]:
        """The topmost paths a promote leaves out (ephemeral, rebuildable)."""
        return frozenset(p for p, cls in self.special.items() if cls not in KEPT)

    @property
    def shared(self) -> list[str]:
        """The topmost shared paths, which a promote takes from the head."""
        return [p for p, cls in self.special.items() if cls == SHARED]

    @property
    def inputs(self) -> list[str]:
        """The inputs whose digests a promote records: those of the recipes with outputs,
        each once, in file order."""
        if self.policy is None:
            return []
        return list(dict.fromkeys(p for name, spec in self.policy.recipes.items()
                                  if name in self.classified.outputs for p in spec.inputs))

    def check(self) -> None:
        """Raise InvalidArgument (EINVAL) naming every problem, if there is one."""
        if self.problems:
            raise InvalidArgument(self._stopped("; ".join(self.problems)))

    def stopped(self, exc: RametError) -> RametError:
        """``exc`` (of an input's digest: :class:`InputError`) as the error of the promote
        it stops, its errno kept."""
        return type(exc)(exc.errno, self._stopped(str(exc)))

    def _stopped(self, why: str) -> str:
        return f"promote stopped by the policy ({self.policy.source}): {why}"

    def report(self) -> dict:
        """The preview (``.ramet/preview``): ``{"ok", "policy", "paths", "totals",
        "recipes", "problems"}``; ``paths`` are ``{"path", "class", "bytes", "files"[,
        "recipe"]}`` (directories end in ``/``), ``totals`` per class ``{"paths", "files",
        "bytes"}``, ``recipes`` as :meth:`recipes` without the digests, ``problems`` what
        would stop a promote."""
        totals = {cls: {"paths": 0, "files": 0, "bytes": 0} for cls in CLASSES}
        paths = []
        for path, cls, _kind, files, nbytes, recipe in self.classified.paths:
            item = {"path": path, "class": cls, "bytes": nbytes, "files": files}
            if recipe:
                item["recipe"] = recipe
            paths.append(item)
            t = totals[cls]
            t["paths"] += 1
            t["files"] += files
            t["bytes"] += nbytes
        recipes = [{**r, "inputs": [i["path"] for i in r["inputs"]]}
                   for r in self.recipes(dict.fromkeys(self.inputs))]
        return {"ok": not self.problems,
                "policy": self.policy.source if self.policy else None, "paths": paths,
                "totals": totals, "recipes": recipes, "problems": list(self.problems)}

    def stats(self) -> dict:
        """What a promote records in its snapshot's stats: ``{"policy": source, "left_out":
        {class: {"paths", "files", "bytes"}}}`` for the rebuildable and ephemeral paths;
        ``{}`` without a policy."""
        if self.policy is None:
            return {}
        left_out = {cls: {"paths": 0, "files": 0, "bytes": 0} for cls in (REBUILDABLE, EPHEMERAL)}
        for _path, cls, _kind, files, nbytes, _recipe in self.classified.paths:
            if cls in left_out:
                t = left_out[cls]
                t["paths"] += 1
                t["files"] += files
                t["bytes"] += nbytes
        return {"policy": self.policy.source, "left_out": left_out}

    def recipes(self, digests: dict[str, str | None]) -> list[dict]:
        """The recipes a promote stores (docs/format.md): one per recipe with outputs, in
        file order, ``{"name", "outputs", "inputs": [{"path", "blake3"}], "command",
        "check", "timeout"}``.  ``digests`` maps each of :attr:`inputs` to its
        :func:`path_digest`."""
        if self.policy is None:
            return []
        return [{"name": name, "outputs": self.classified.outputs[name],
                 "inputs": [{"path": p, "blake3": digests[p]} for p in spec.inputs],
                 "command": list(spec.command),
                 "check": list(spec.check) if spec.check else None, "timeout": spec.timeout}
                for name, spec in self.policy.recipes.items()
                if name in self.classified.outputs]


def apply_steps(policy: Policy | None, tree: Tree, root, side: Side, durable: bool = False,
                paths: list | None = None) -> Steps[Plan]:
    """The :class:`Plan` of ``policy`` over the execution whose tree is ``tree`` from
    ``root`` (``durable``, ``paths``: as :func:`classify_steps` takes them; a preview lists
    durable files, a promote need not), as steps: one per directory classified, and those
    of ``side.changes`` when the policy has shared paths.  Without a policy and
    ``durable=False``, nothing is walked."""
    if policy is None and not durable:
        return Plan(None)
    classified = yield from classify_steps(policy, tree, root, durable, paths)
    if policy is None:
        return Plan(None, classified)
    plan = Plan(policy, classified)
    problems = []
    if policy.patterns[SHARED]:
        memo: dict = {}
        for letter, raw in (yield from side.changes(plan.skip)):
            path = os.fsdecode(raw)
            cls, _recipe, _top = policy.class_of(path.rstrip("/"), path.endswith("/"), memo)
            if cls == SHARED:
                problems.append(f"shared path changed: {letter} {quote_path(raw)}")
    memo = {}
    for name in classified.outputs:
        for path in policy.recipes[name].inputs:
            is_dir = side.exists(path)
            shown = quote_path(os.fsencode(path))
            if is_dir is None:
                problems.append(f"recipe {name}: input {shown} is missing")
                continue
            cls, _recipe, top = policy.class_of(path, is_dir, memo)
            if cls not in KEPT:
                problems.append(f"recipe {name}: input {shown} is {cls} "
                                f"({quote_path(os.fsencode(top))}), so a promote would not "
                                "keep it")
    return Plan(policy, classified, tuple(problems))


def apply(policy: Policy | None, tree: Tree, root, side: Side, durable: bool = False) -> Plan:
    """:func:`apply_steps`, at once."""
    return run_steps(apply_steps(policy, tree, root, side, durable))


# -- input digests -----------------------------------------------------------------------------

MAX_INPUT_BYTES = 1 << 30  # of one recipe input's regular files, at a promote and a restore


class InputError(RametError):
    """A recipe input that cannot be hashed where it is (:func:`path_digest`); the message
    names it and says why, the errno is ENOENT, EAGAIN or EFBIG."""


def input_too_big(path: str) -> InputError:
    """EFBIG: the regular files of input ``path`` hold more than :data:`MAX_INPUT_BYTES`
    (holes counted: its digest hashes every byte)."""
    return InputError(errno.EFBIG, f"input {quote_path(os.fsencode(path))} holds more than "
                                   f"{MAX_INPUT_BYTES} bytes")


def tree_digest(items: Iterable[tuple[bytes, str, str]]) -> str:
    """The digest of a directory input: BLAKE3 (hex) of one line ``<kind> <hash> <path>\\n``
    per path below it, sorted by path bytes; kind ``f`` (hash: BLAKE3 of the bytes), ``l``
    (BLAKE3 of the target), ``d`` or ``o`` (hash ``-``)."""
    h = blake3.blake3()
    for path, kind, digest in sorted(items):
        h.update(kind.encode() + b" " + digest.encode() + b" " + path + b"\n")
    return h.hexdigest()


def path_digest(root: str | os.PathLike, path: str) -> str:
    """The digest of recipe input ``path`` (relative, ``/``-separated) of the tree at the
    directory ``root``: BLAKE3 (hex) of a regular file's bytes (as ``b3sum`` prints it),
    :func:`tree_digest` of a directory, BLAKE3 of a symlink's target, BLAKE3 of no bytes
    for anything else.  Blocking.

    The tree may be an agent's, read as root (a restore; a promote in fallback mode), so only
    ``root`` is resolved as a path (the caller's, trusted); below it every name is opened
    relative to its directory's fd and checked against its listing (rametfs.nofollow):
    no symlink is followed, on the way to ``path`` or below it, no FIFO or device is opened,
    a directory is walked with one directory fd open at a time (back up through ``..``, which
    must be the directory it came from), and at most :data:`MAX_INPUT_BYTES` of file bytes are
    read.  So the digest is of bytes inside the tree only.

    Raises InputError: ENOENT when ``path`` is missing or a name on its way is missing, a
    symlink or not a directory; EAGAIN when an entry changed while it was hashed; EFBIG when
    its regular files hold more than :data:`MAX_INPUT_BYTES` (refused before reading them
    when their sizes say so).  OSError when the tree cannot be read.
    """
    found = _Input(path)
    with found.parent(root) as (fd, name):
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise found.fail("is missing", errno.ENOENT) from None
        if stat.S_ISDIR(st.st_mode):
            return tree_digest(found.tree(fd, name, st))
        return found.leaf(fd, name, st, b"") or blake3.blake3(b"").hexdigest()


def exists_under(root: str | os.PathLike) -> Callable[[str], bool | None]:
    """``exists(path)`` for rametfs.core.policy.Side over the tree at the directory ``root``:
    whether input ``path`` is a directory, None when :func:`path_digest` finds it missing
    (so a path through a symlink is missing).  Blocking."""
    def exists(path: str) -> bool | None:
        found = _Input(path)
        try:
            with found.parent(root) as (fd, name):
                return stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return None
        except InputError as exc:
            if exc.errno != errno.ENOENT:
                raise
            return None
    return exists


class _Input:
    """One input being read for :func:`path_digest`: its ``path`` (for messages) and the
    file bytes it may still read."""

    def __init__(self, path: str):
        self.path = path
        self.left = MAX_INPUT_BYTES
        self.reading = True  # False: a directory's first walk, which only adds up sizes
        self.buffer: bytearray | None = None

    def fail(self, what: str, err: int) -> InputError:
        return InputError(err, f"input {quote_path(os.fsencode(self.path))} {what}")

    def changed(self, rel: bytes, what: str) -> InputError:
        """``rel`` (below the input, ``b""`` itself) changed under the walk: EAGAIN."""
        where = os.fsencode(self.path) + (b"/" + rel if rel else b"")
        return self.fail(f"changed while it was hashed: {quote_path(where)} {what}",
                         errno.EAGAIN)

    def too_big(self) -> InputError:
        return input_too_big(self.path)

    @contextlib.contextmanager
    def parent(self, root: str | os.PathLike) -> Iterator[tuple[int, bytes]]:
        """``(fd, name)``: the directory holding the input's last name, reached from
        ``root`` one name at a time, and that name; InputError (ENOENT) naming the first
        name on the way that is missing, a symlink or not a directory."""
        names = os.fsencode(self.path).split(b"/")
        fd = os.open(root, DIR_FLAGS)
        try:
            for i, name in enumerate(names[:-1]):
                try:
                    sub = os.open(name, DIR_FLAGS, dir_fd=fd)
                except (FileNotFoundError, NotADirectoryError):
                    raise self._not_a_directory(fd, names[:i + 1]) from None
                os.close(fd)
                fd = sub
            yield fd, names[-1]
        finally:
            os.close(fd)

    def _not_a_directory(self, fd: int, names: list[bytes]) -> InputError:
        """Why the directory ``names`` (its last one in ``fd``) on the input's way cannot
        be entered (O_DIRECTORY | O_NOFOLLOW says ENOTDIR for a symlink too)."""
        try:
            st = os.stat(names[-1], dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return self.fail("is missing", errno.ENOENT)
        what = ("is a symlink, which is not followed" if stat.S_ISLNK(st.st_mode)
                else "is not a directory")
        return self.fail(f"is missing: {quote_path(b'/'.join(names))} {what}", errno.ENOENT)

    def leaf(self, fd: int, name: bytes, st: os.stat_result, rel: bytes) -> str | None:
        """The digest of the entry ``name`` of directory ``fd`` (``rel`` below the input),
        listed as ``st`` and not a directory: a regular file's bytes or a symlink's target,
        None for anything else (never opened) and when not :attr:`reading`."""
        regular = stat.S_ISREG(st.st_mode)
        if regular and st.st_size > self.left:
            raise self.too_big()
        if not self.reading:
            self.left -= st.st_size if regular else 0
            return None
        if stat.S_ISLNK(st.st_mode):
            try:
                return blake3.blake3(os.readlink(name, dir_fd=fd)).hexdigest()
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.EINVAL):
                    raise
                raise self.changed(rel, "is no longer a symlink") from None
        if not regular:
            return None
        f = self._open(fd, name, FILE_FLAGS, st, rel)
        try:
            os.set_blocking(f, True)  # a regular file: O_NONBLOCK only guarded the open
            if self.buffer is None:
                self.buffer = bytearray(_READ_BYTES)
            view = memoryview(self.buffer)
            h = blake3.blake3()
            while n := os.readv(f, [self.buffer]):
                self.left -= n
                if self.left < 0:  # it grew past its listed size
                    raise self.too_big()
                h.update(view[:n])
            return h.hexdigest()
        finally:
            os.close(f)

    def _open(self, fd: int, name: bytes, flags: int, st: os.stat_result, rel: bytes,
              other: str = "is another file than the one listed") -> int:
        """``name`` of directory ``fd`` opened with ``flags``, checked to be the file listed
        as ``st``; InputError (EAGAIN) saying that ``rel`` is gone, or ``other``."""
        try:
            opened = os.open(name, flags, dir_fd=fd)
        except OSError as exc:
            if exc.errno not in GONE:
                raise
            raise self.changed(rel, GONE[exc.errno]) from None
        if not same_file(os.fstat(opened), st):
            os.close(opened)
            raise self.changed(rel, other)
        return opened

    def tree(self, fd: int, name: bytes, st: os.stat_result) -> list[tuple[bytes, str, str]]:
        """``(path below the input, kind, digest)`` for :func:`tree_digest`, of every entry
        below the directory ``name`` of ``fd`` (listed as ``st``).  Walked twice: first
        adding up its files' sizes, so that a directory past :data:`MAX_INPUT_BYTES` is
        refused before a byte is read, then hashing them."""
        self.reading = False
        self._walk(fd, name, st)
        self.reading, self.left = True, MAX_INPUT_BYTES
        return self._walk(fd, name, st)

    def _walk(self, fd: int, name: bytes, st: os.stat_result) -> list[tuple[bytes, str, str]]:
        """:meth:`tree`'s items, depth first with one directory fd open at a time."""
        items: list[tuple[bytes, str, str]] = []
        fd = self._open(fd, name, DIR_FLAGS, st, b"")
        try:
            stack = [(b"", st, iter(self._list(fd, b"", items)))]
            while True:
                rel, _st, pending = stack[-1]
                child = next(pending, None)
                if child is None:
                    stack.pop()
                    if not stack:
                        return items
                    up = self._open(fd, b"..", DIR_FLAGS, stack[-1][1], rel, "was moved")
                    os.close(fd)
                    fd = up
                    continue
                sub_name, sub_st = child
                sub_rel = rel + b"/" + sub_name if rel else sub_name
                sub = self._open(fd, sub_name, DIR_FLAGS, sub_st, sub_rel)
                os.close(fd)
                fd = sub
                stack.append((sub_rel, sub_st, iter(self._list(fd, sub_rel, items))))
        finally:
            os.close(fd)

    def _list(self, fd: int, rel: bytes, items: list[tuple[bytes, str, str]]
              ) -> list[tuple[bytes, os.stat_result]]:
        """Add the entries of directory ``fd`` (``rel`` below the input) to ``items``, each
        file hashed now (when :attr:`reading`); return its subdirectories ``(name,
        lstat)``, to walk next."""
        below = []
        for name in map(os.fsencode, os.listdir(fd)):
            path = rel + b"/" + name if rel else name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                raise self.changed(path, "is gone") from None
            if stat.S_ISDIR(st.st_mode):
                items.append((path, "d", "-"))
                below.append((name, st))
                continue
            digest = self.leaf(fd, name, st, path)
            items.append((path, kind_of(st.st_mode), digest or "-"))
        return below
