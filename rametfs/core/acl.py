"""POSIX ACLs (POSIX.1e draft 17, as Linux has them): the ``system.posix_acl_access`` and
``system.posix_acl_default`` xattr values, and the rules that tie them to the mode.

A value is the Linux xattr layout (``include/uapi/linux/posix_acl_xattr.h``): a 4-byte
little-endian header, version 2, then entries of 8 bytes, each ``(tag u16, perm u16, id
u32)``: ``USER_OBJ`` ``USER``* ``GROUP_OBJ`` ``GROUP``* ``MASK``? ``OTHER``, a named entry's
id its uid or gid, the others' id 0xffffffff.  :func:`decode` checks a value as the kernel does
(``posix_acl_from_xattr`` and ``posix_acl_valid``, fs/posix_acl.c): InvalidArgument (EINVAL)
for a wrong header, length, tag, permission, order or id, or a named entry without a mask;
E2BIG past :data:`MAX_BYTES`.

Who does what with FUSE_POSIX_ACL (Linux 6.x, fs/fuse; the daemon asks for it with
``Operations.enable_acl`` and for FUSE_DONT_MASK with the patched pyfuse3's ``dont_mask``):

* The kernel enforces the access ACL itself in its permission checks (FUSE_POSIX_ACL turns
  ``default_permissions`` on: ``process_init_reply``, fs/fuse/inode.c), reading it with a
  GETXATTR (``fuse_get_inode_acl``, fs/fuse/acl.c) the first time a caller other than the
  owner needs it, and caching it, an absent ACL too, until the inode's attributes are
  refreshed (``forget_all_cached_acls`` in ``fuse_setattr``, ``fuse_dentry_revalidate``,
  readdirplus and ``fuse_set_acl``; fs/fuse/dir.c, readdir.c).  ``fuse_get_acl`` reads at
  most a page (:data:`MAX_BYTES`), ``fuse_set_acl`` writes at most one (E2BIG).
* A setfacl reaches the daemon as the SETXATTR of a value the kernel has parsed, checked
  (``posix_acl_valid``, and ``vfs_set_acl``: the owner or CAP_FOWNER only, a default ACL on
  directories only) and written anew, or as a REMOVEXATTR for an empty one.  It does *not*
  change the mode: "Fuse userspace is responsible for updating access permissions in the
  inode" (``fuse_set_acl``).  So the daemon sets the mode an access ACL implies and stores
  no ACL that the mode says whole (:func:`equivalent_mode`, ``posix_acl_update_mode``, as
  ``ext4_set_acl`` does), and clears the set-group-ID bit when the setter is neither in the
  file's group nor root: the kernel would say so only with FUSE_SETXATTR_EXT
  (FUSE_SETXATTR_ACL_KILL_SGID), which libfuse 3.14 does not negotiate.
* chmod reaches the daemon as a SETATTR; the kernel only forgets its cached ACLs.  The daemon
  rewrites the access ACL's owner, mask (or group, without a mask) and other entries from the
  new mode (:func:`chmod`, ``posix_acl_chmod``).
* Creation: the kernel sets SB_POSIXACL on every FUSE super block (``fuse_fill_super_common``,
  fs/fuse/inode.c), so the VFS never applies the umask there, and ``fuse_create_open``,
  ``fuse_mknod`` and ``fuse_mkdir`` (fs/fuse/dir.c) apply it themselves unless FUSE_DONT_MASK
  was negotiated (``fc->dont_mask``, ``process_init_reply``), sending the umask in the
  request either way; the kernel inherits no default ACL.  (The VFS still strips a new file's
  set-group-ID bit for a caller outside the directory's group: ``vfs_prepare_mode``.)  So
  with FUSE_DONT_MASK the daemon does what ``posix_acl_create`` does on ext4
  (:func:`inherit`): in a directory with a default ACL, a new node's access ACL comes from
  it, masked by the requested mode, a new directory also gets the default ACL, and the umask
  is not applied; elsewhere the umask is.  A symlink gets neither (mode 0777).  With stock
  pyfuse3 (no patch) the kernel has applied the umask already, so a node inherits from the
  umasked mode.

Pure functions of values and modes, for both modes: fallback mode's host file system applies
the same rules itself (rametfs.fallback.sync removes what it inherits unasked).
"""

from __future__ import annotations

import errno
import stat
import struct
from typing import NamedTuple

from ..errors import InvalidArgument, RametError

ACCESS = b"system.posix_acl_access"
DEFAULT = b"system.posix_acl_default"
NAMES = (ACCESS, DEFAULT)

VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
UNDEFINED_ID = 0xFFFFFFFF
MAX_BYTES = 4096  # a page: what fuse_get_acl reads and fuse_set_acl writes at most

_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
_PERMS = 0o7
_RWX = stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO


class Entry(NamedTuple):
    tag: int
    perm: int  # rwx, 0 to 7
    id: int  # a USER's uid or a GROUP's gid; UNDEFINED_ID for the others


Acl = tuple[Entry, ...]


def decode(value: bytes) -> Acl:
    """The entries of xattr value ``value``, checked as ``posix_acl_from_xattr`` and
    ``posix_acl_valid`` check them; InvalidArgument (EINVAL) with what is wrong, RametError
    (E2BIG) past :data:`MAX_BYTES`."""
    if len(value) > MAX_BYTES:
        raise RametError(errno.E2BIG, f"a POSIX ACL takes at most {MAX_BYTES} bytes")
    if len(value) < _HEADER.size or (len(value) - _HEADER.size) % _ENTRY.size:
        raise InvalidArgument("a POSIX ACL is a 4-byte header and 8-byte entries, not "
                              f"{len(value)} bytes")
    (version,) = _HEADER.unpack_from(value)
    if version != VERSION:
        raise InvalidArgument(f"POSIX ACL version {version}: only {VERSION} is known")
    acl = tuple(Entry(*e) for e in _ENTRY.iter_unpack(value[_HEADER.size:]))
    _check(acl)
    return tuple(e if e.tag in (USER, GROUP) else e._replace(id=UNDEFINED_ID) for e in acl)


def _check(acl: Acl) -> None:
    """``posix_acl_valid``: the order of the tags, each named entry's id, the mask."""
    state, named = USER_OBJ, False
    for e in acl:
        if e.perm & ~_PERMS:
            raise InvalidArgument(f"POSIX ACL permission {e.perm:#x} is not rwx")
        if e.tag in (USER, GROUP):
            if e.id == UNDEFINED_ID:
                raise InvalidArgument("a named POSIX ACL entry has no id")
            named = True
        if e.tag == USER_OBJ and state == USER_OBJ:
            state = USER
        elif e.tag == USER and state == USER:
            pass
        elif e.tag == GROUP_OBJ and state == USER:
            state = GROUP
        elif e.tag == GROUP and state == GROUP:
            pass
        elif e.tag == MASK and state == GROUP:
            state = OTHER
        elif e.tag == OTHER and (state == OTHER or state == GROUP and not named):
            state = 0
        else:
            raise InvalidArgument(f"POSIX ACL entries out of order or unknown (tag {e.tag:#x}): "
                                  "user::, user:*, group::, group:*, mask::, other::")
    if state != 0:
        raise InvalidArgument("a POSIX ACL needs user::, group:: and other:: entries, and "
                              "mask:: with named ones")


def encode(acl: Acl) -> bytes:
    """The xattr value of ``acl`` (as ``posix_acl_to_xattr`` writes it)."""
    return _HEADER.pack(VERSION) + b"".join(_ENTRY.pack(*e) for e in acl)


def equivalent_mode(acl: Acl, mode: int) -> tuple[int, bool]:
    """``posix_acl_equiv_mode``: ``mode`` with the permission bits ``acl`` gives (the
    owner's, the mask's or else the group's, the others'), and whether those bits say all
    of ``acl`` (no mask, no named entry: then no ACL is stored)."""
    bits, whole, group = 0, True, 0
    for e in acl:
        if e.tag == USER_OBJ:
            bits |= e.perm << 6
        elif e.tag == GROUP_OBJ:
            group = e.perm << 3
        elif e.tag == OTHER:
            bits |= e.perm
        elif e.tag == MASK:
            group, whole = e.perm << 3, False
        else:
            whole = False
    return (mode & ~_RWX) | bits | group, whole


def chmod(acl: Acl, mode: int) -> Acl:
    """``posix_acl_chmod``: ``acl`` after a chmod to ``mode``: the owner's, the others' and
    the mask's (or, without a mask, the group's) permissions are the mode's."""
    has_mask = any(e.tag == MASK for e in acl)
    perms = {USER_OBJ: mode >> 6 & _PERMS, OTHER: mode & _PERMS,
             MASK if has_mask else GROUP_OBJ: mode >> 3 & _PERMS}
    return tuple(e._replace(perm=perms[e.tag]) if e.tag in perms else e for e in acl)


def inherit(default: Acl, mode: int) -> tuple[int, Acl | None]:
    """``posix_acl_create`` for a new node of ``mode`` (type and permission bits as
    requested, before any umask) in a directory whose default ACL is ``default``: its mode
    (the requested bits masked by the ACL's) and its access ACL, None where the mode says
    all of it (``posix_acl_create_masq``)."""
    out, whole = [], True
    group_obj = mask = None
    for e in default:
        if e.tag == USER_OBJ:
            e = e._replace(perm=e.perm & (mode >> 6 & _PERMS))
            mode &= ~stat.S_IRWXU | e.perm << 6
        elif e.tag == OTHER:
            e = e._replace(perm=e.perm & (mode & _PERMS))
            mode &= ~stat.S_IRWXO | e.perm
        elif e.tag == GROUP_OBJ:
            group_obj = len(out)
        elif e.tag == MASK:
            mask, whole = len(out), False
        else:
            whole = False
        out.append(e)
    i = mask if mask is not None else group_obj
    e = out[i]
    out[i] = e = e._replace(perm=e.perm & (mode >> 3 & _PERMS))
    mode &= ~stat.S_IRWXG | e.perm << 3
    return mode, None if whole else tuple(out)
