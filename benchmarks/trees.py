"""Source trees the workloads run on: the Python library directory, synthetic trees of small
files, one big incompressible file, and the helpers that change files in a view.

A :class:`Tree` is built once under the scratch directory and never written again: it is the
lower layer of the overlay systems, the source of ``cp -a``, ``git worktree`` and the rametfs
snapshot.  Each system's writable views are where the workloads write.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20
# git with a fixed identity, no user or system config, no background gc, fast compression.
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@rametfs.invalid",
    "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@rametfs.invalid",
    "GIT_CONFIG_COUNT": "4",
    "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*",
    "GIT_CONFIG_KEY_1": "gc.auto", "GIT_CONFIG_VALUE_1": "0",
    "GIT_CONFIG_KEY_2": "core.compression", "GIT_CONFIG_VALUE_2": "1",
    "GIT_CONFIG_KEY_3": "init.defaultBranch", "GIT_CONFIG_VALUE_3": "main",
}


class BenchError(RuntimeError):
    """A command the benchmark relies on failed; the message has its stderr."""


def run(*argv: str | os.PathLike, cwd: str | os.PathLike | None = None,
        env: dict[str, str] | None = None, inherit_env: bool = True) -> None:
    """Run a command, its stdout discarded, with ``env`` added to this process's environment
    (or, without ``inherit_env``, only ``env``).  Raises BenchError with its stderr on
    failure."""
    if not inherit_env:
        env = env or {}
    elif env:
        env = {**os.environ, **env}
    done = subprocess.run([os.fspath(a) for a in argv], cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env)
    if done.returncode != 0:
        raise BenchError(f"{' '.join(map(str, argv))} exited {done.returncode}: "
                         f"{done.stderr.strip()[-2000:]}")


def git(*args: str, cwd: str | os.PathLike) -> None:
    """Run ``git ARGS`` in ``cwd`` with :data:`GIT_ENV`."""
    run("git", *args, cwd=cwd, env=GIT_ENV)


@dataclass(frozen=True)
class Tree:
    """A read-only source tree.

    ``files``: paths of its regular files relative to ``path``, sorted, ``.git`` left out;
    ``bytes``: their total size; ``git``: whether ``path`` is a git repository whose one
    commit holds every file.
    """

    name: str
    path: Path
    files: tuple[str, ...]
    bytes: int
    git: bool = False

    def sample(self, count: int, seed: int) -> list[str]:
        """``count`` distinct files picked by ``seed`` (all of them when there are fewer)."""
        return random.Random(seed).sample(self.files, min(count, len(self.files)))


def scan(name: str, path: Path, git_repo: bool = False) -> Tree:
    """The tree at ``path`` as it is on disk (its regular files, a top-level ``.git`` left
    out)."""
    files, total = [], 0
    for dirpath, dirnames, filenames in os.walk(path):
        if dirpath == str(path) and ".git" in dirnames:
            dirnames.remove(".git")
        for f in filenames:
            full = os.path.join(dirpath, f)
            st = os.lstat(full)
            if os.path.isfile(full) and not os.path.islink(full):
                files.append(os.path.relpath(full, path))
                total += st.st_size
    return Tree(name, path, tuple(sorted(files)), total, git_repo)


def make_git_repo(tree: Tree) -> Tree:
    """Commit every file of ``tree`` in a new repository at its root, objects packed (so
    ``.git`` adds tens of files, not one per object).  Returns the tree with ``git=True``."""
    git("init", "-q", cwd=tree.path)
    git("add", "-A", "-f", cwd=tree.path)  # -f: files a .gitignore in the tree names too
    git("commit", "-q", "-m", "base", cwd=tree.path)
    git("repack", "-adq", "--window=0", cwd=tree.path)
    git("prune-packed", cwd=tree.path)
    return Tree(tree.name, tree.path, tree.files, tree.bytes, True)


def stdlib_tree(dest: Path, *, with_site_packages: bool) -> Tree:
    """Copy the running Python's library directory (``sysconfig`` ``stdlib``) to ``dest``
    with ``cp -a``; ``site-packages`` only when ``with_site_packages``."""
    source = Path(sysconfig.get_paths()["stdlib"])
    dest.mkdir(parents=True)
    entries = [e for e in sorted(source.iterdir())
               if with_site_packages or e.name != "site-packages"]
    run("cp", "-a", *entries, dest)
    return scan("stdlib", dest)


def synthetic_tree(dest: Path, count: int) -> Tree:
    """``count`` small text files (10 B to 2 KB, 100 a directory, two levels) under ``dest``."""
    rng = random.Random(count)
    dest.mkdir(parents=True, exist_ok=True)
    files, total = [], 0
    for i in range(count):
        rel = f"d{i // 10000:03d}/d{i // 100 % 100:02d}/f{i % 100:02d}.txt"
        if i % 100 == 0:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        data = f"line of file {i}\n".encode() * rng.randint(1, 100)
        (dest / rel).write_bytes(data)
        files.append(rel)
        total += len(data)
    return Tree(f"synthetic-{count}", dest, tuple(sorted(files)), total)


BIG_FILE = "big.bin"


def big_tree(dest: Path, size: int) -> Tree:
    """One file of ``size`` random (incompressible) bytes, ``dest/big.bin``, fsync'd; the
    tree is named after ``dest``."""
    dest.mkdir(parents=True)
    with open(dest / BIG_FILE, "wb") as f:
        for _ in range(size // MIB):
            f.write(os.urandom(MIB))
        f.write(os.urandom(size % MIB))
        f.flush()
        os.fsync(f.fileno())
    return Tree(dest.name, dest, (BIG_FILE,), size)


def tarball(tree: Tree, dest: Path) -> Path:
    """An uncompressed tar of ``tree`` without ``.git`` at ``dest``."""
    run("tar", "-cf", dest, "--exclude=./.git", "-C", tree.path, ".")
    return dest


def change_files(view: Path, files: list[str], tag: str) -> int:
    """Append one line naming ``tag`` to each of ``files`` under ``view``; return the total
    size of the changed files afterwards (bytes)."""
    line = f"# changed by the rametfs benchmark: {tag}\n".encode()
    total = 0
    for rel in files:
        with open(view / rel, "ab") as f:
            f.write(line)
            total += f.tell()
    return total


def remove(path: Path) -> None:
    """``rm -rf path`` (works on trees holding a work dir that overlayfs made mode 000)."""
    if path.exists() or path.is_symlink():
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


@dataclass(frozen=True)
class Size:
    """A benchmark size: the main tree (``synthetic`` files, or the library directory with or
    without ``site-packages``), the big file's bytes and the scaling tree sizes (files)."""

    name: str
    synthetic: int | None
    site_packages: bool
    big_bytes: int
    scales: tuple[int, ...]

    def main_tree(self, dest: Path) -> Tree:
        """Build the main tree at ``dest`` (not yet a git repository)."""
        if self.synthetic is not None:
            return synthetic_tree(dest, self.synthetic)
        return stdlib_tree(dest, with_site_packages=self.site_packages)


SIZES = {
    "smoke": Size("smoke", 300, False, 8 * MIB, (100, 1000)),
    "small": Size("small", None, False, 256 * MIB, (1000, 10_000)),
    "full": Size("full", None, True, 1024 * MIB, (1000, 10_000, 100_000)),
}
SCALE_1M = 1_000_000
