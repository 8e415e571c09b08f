"""Opening names in a tree someone else controls: by directory fd, never through a symlink.

Root reads trees an agent may change while it reads them: an import's source
(rametfs.store.importer), a recipe's inputs at a promote in fallback mode and at a restore
(rametfs.core.policy.path_digest).  Each name is opened relative to its directory's open fd
(``openat``) with one of these flag sets, after the directory was listed (``fstatat``, not
followed), and the fstat of what was opened must be the listed file (:func:`same_file`):

- :data:`DIR_FLAGS`: ``O_DIRECTORY | O_NOFOLLOW``, so a symlink is never entered (ENOTDIR);
- :data:`FILE_FLAGS`: ``O_NOFOLLOW | O_NONBLOCK | O_NOCTTY``, so a FIFO swapped in for a
  regular file cannot block the open (it then fails the fstat check), and a tty is never
  made the controlling one.  Clear ``O_NONBLOCK`` before reading the regular file.

Standard library only: the harness side (rametfs.restore) uses it without the store.
"""

from __future__ import annotations

import errno
import os
import stat

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
# What an open(2) of a listed name failing with these says about it
GONE = {errno.ENOENT: "is gone", errno.ELOOP: "is now a symlink",
        errno.ENOTDIR: "is no longer a directory", errno.ENXIO: "is now a socket"}


def same_file(st: os.stat_result, listed: os.stat_result) -> bool:
    """Whether ``st`` is the inode the listing saw: device, inode number and file type."""
    return (st.st_dev == listed.st_dev and st.st_ino == listed.st_ino
            and stat.S_IFMT(st.st_mode) == stat.S_IFMT(listed.st_mode))
