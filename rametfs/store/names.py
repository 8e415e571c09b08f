"""Snapshot names: movable names for snapshots, like git branches (the ``names`` database).

A name follows git's ref rules (git-check-ref-format(1)), on a smaller alphabet: ASCII letters,
digits and ``. _ + - /``, at most :data:`MAX_NAME_BYTES`; ``/`` separates components, none
empty, none starting with ``.`` or ending with ``.lock``; no ``..``; not ending with ``.`` or
``/``; not starting with ``-`` (it would read as an option).  A name of
:data:`MIN_ID_PREFIX` or more hex digits alone is refused: it would be ambiguous with a
snapshot id prefix, which every command also takes (rametfs.store.Store.snapshot).
"""

from __future__ import annotations

import re

from ..errors import InvalidArgument

MAX_NAME_BYTES = 200
MIN_ID_PREFIX = 8  # hex digits of the shortest snapshot id prefix a command takes
_ALPHABET = re.compile(r"[A-Za-z0-9._+/-]+")
HEX_REF = re.compile(rf"[0-9A-Fa-f]{{{MIN_ID_PREFIX},}}")
SNAPSHOT_ID_RE = re.compile(r"[0-9a-f]{64}")  # a snapshot id as the store spells it


def check_name(name: str) -> None:
    """Raise InvalidArgument (EINVAL), saying why, unless ``name`` is a valid snapshot name."""
    why = None
    if not name:
        why = "it is empty"
    elif len(name) > MAX_NAME_BYTES:
        why = f"it is longer than {MAX_NAME_BYTES} characters"
    elif not _ALPHABET.fullmatch(name):
        why = "it may hold only ASCII letters, digits and . _ + - /"
    elif HEX_REF.fullmatch(name):
        why = (f"{MIN_ID_PREFIX} or more hex digits alone would be ambiguous with a snapshot "
               "id prefix")
    elif name.startswith("-"):
        why = "it starts with -"
    elif ".." in name or name.endswith((".", "/")):
        why = "it holds .. or ends with . or /"
    elif any(not part or part.startswith(".") or part.endswith(".lock")
             for part in name.split("/")):
        why = "a /-separated component is empty, starts with . or ends with .lock"
    if why:
        raise InvalidArgument(f"bad snapshot name {name!r}: {why} (names follow git's ref "
                              "rules: docs/lifecycle.md)")
