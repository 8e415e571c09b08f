"""The inputs of the agent workloads (issue 21), fetched once from the package registries into
the cache directory (``--cache``) and reused by every later run.

| input | made from | cached as |
|---|---|---|
| a git repository of successive Django releases | the sdists of :data:`DJANGO_RELEASES` (``pip download``), each release one commit of the tree it unpacks to, tagged ``django-<version>`` | ``django-sdists/``, ``django-repo/`` |
| wheels to install offline | ``pip download`` of :data:`WHEELS` and their dependencies for the running Python | ``wheels-cp<major><minor>/`` |
| an npm project and its cache | the ``dependencies`` of :data:`NPM_PROJECT`'s published ``package.json`` (``npm pack``), locked with ``npm install --package-lock-only``, then one ``npm ci`` to fill npm's cache | ``npm/project/``, ``npm/cache/`` |

Each input is built in a temporary directory beside its place and renamed into it when complete,
so an interrupted set-up leaves nothing half made and a rerun downloads nothing.  Nothing here
runs unless an agent workload is selected.  An input that cannot be made (no npm, a registry out
of reach) raises :class:`~benchmarks.systems.Unsupported` with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .systems import Unsupported
from .trees import GIT_ENV, BenchError, Tree, git, run, scan

# Three releases, two years apart: checking out the first from the last changes thousands of
# files.
DJANGO_RELEASES = ("4.0", "4.2.16", "5.1.4")
WHEELS = ("numpy==2.2.6", "pandas==2.2.3", "django==5.1.4", "flask==3.1.0",
          "sqlalchemy==2.0.36", "requests==2.32.3", "rich==13.9.4", "pytest==8.3.4")
IMPORTS = ("pandas", "django", "sqlalchemy", "flask", "rich")
OLD_REVISION = f"django-{DJANGO_RELEASES[0]}"  # the checkout goes there from main and back
NPM_PROJECT = "eslint@8.57.1"
# Fixed commit dates: the repository is the same on every machine that builds it.
COMMIT_DATE = "2024-12-03T00:00:00Z"


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/rametfs-bench``, else ``~/.cache/rametfs-bench``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rametfs-bench"


def _say(message: str) -> None:
    print(f"agent set-up: {message}", file=sys.stderr, flush=True)


def _cached(dest: Path, what: str, build: Callable[[Path], None]) -> Path:
    """``dest`` if it exists; else ``build(tmp)`` into a new directory beside it, renamed to
    ``dest`` once complete.  Raises Unsupported naming ``what`` when the build fails."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    _say(f"{what} -> {dest}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        build(tmp)
        tmp.rename(dest)
    except (OSError, BenchError, subprocess.SubprocessError, ValueError, KeyError) as exc:
        raise Unsupported(f"{what} failed: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _pip(*args: str | os.PathLike) -> None:
    run(sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q")


def django_sdists(cache: Path) -> list[Path]:
    """The sdists of :data:`DJANGO_RELEASES`, oldest first (downloaded once)."""
    def download(tmp: Path) -> None:
        for version in DJANGO_RELEASES:
            _pip("download", "--no-deps", "--no-binary", "django", "-d", tmp,
                 f"django=={version}")
    folder = _cached(cache / "django-sdists", f"downloading the sdists of Django "
                     f"{', '.join(DJANGO_RELEASES)} from PyPI", download)
    return [next(folder.glob(f"[Dd]jango-{v}.tar.gz")) for v in DJANGO_RELEASES]


def django_repo(cache: Path) -> Path:
    """A git repository (branch ``main``, checked out) whose commits are
    :data:`DJANGO_RELEASES` in order, each tagged ``django-<version>``; objects packed."""
    sdists = django_sdists(cache)

    def build(tmp: Path) -> None:
        git("init", "-q", cwd=tmp)
        env = {**GIT_ENV, "GIT_AUTHOR_DATE": COMMIT_DATE, "GIT_COMMITTER_DATE": COMMIT_DATE}
        for version, sdist in zip(DJANGO_RELEASES, sdists):
            for entry in tmp.iterdir():  # a release's deleted files leave the next commit
                if entry.name != ".git":
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
            run("tar", "-xzf", sdist, "--strip-components=1", "-C", tmp)
            git("add", "-A", "-f", cwd=tmp)
            run("git", "commit", "-q", "-m", f"Django {version}", cwd=tmp, env=env)
            git("tag", f"django-{version}", cwd=tmp)
        git("repack", "-adq", cwd=tmp)
        git("prune-packed", cwd=tmp)
    return _cached(cache / "django-repo", "building a git repository of the Django releases",
                   build)


def wheels(cache: Path) -> Path:
    """A directory of the wheels of :data:`WHEELS` and their dependencies for this Python."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return _cached(cache / f"wheels-{tag}", f"downloading wheels of {' '.join(WHEELS)} "
                   f"from PyPI", lambda tmp: _pip("download", "--only-binary", ":all:",
                                                  "-d", tmp, *WHEELS))


def npm_project(cache: Path) -> tuple[Path, Path]:
    """(a directory holding ``package.json`` and ``package-lock.json``, npm's cache holding
    every package the lockfile names).  Raises Unsupported without npm."""
    if shutil.which("npm") is None:
        raise Unsupported("npm is not installed (Debian: apt-get install npm)")

    def build(tmp: Path) -> None:
        npm_cache, project = tmp / "cache", tmp / "project"
        project.mkdir()
        flags = ("--cache", str(npm_cache), "--ignore-scripts", "--no-audit", "--no-fund",
                 "--loglevel=error")
        run("npm", "pack", NPM_PROJECT, *flags, cwd=tmp)
        packed = next(tmp.glob("*.tgz"))
        with tarfile.open(packed) as tar:
            published = json.load(tar.extractfile("package/package.json"))
        packed.unlink()
        (project / "package.json").write_text(json.dumps(
            {"name": "agent-bench-web", "version": "1.0.0", "private": True,
             "description": f"the dependencies of {NPM_PROJECT}",
             "dependencies": published["dependencies"]}, indent=2) + "\n")
        run("npm", "install", "--package-lock-only", *flags, cwd=project)
        run("npm", "ci", *flags, cwd=project)  # fills the cache
        shutil.rmtree(project / "node_modules")
    folder = _cached(cache / "npm", f"locking the dependencies of {NPM_PROJECT} and filling "
                     f"npm's cache from the npm registry", build)
    return folder / "project", folder / "cache"


@dataclass(frozen=True)
class AgentInputs:
    """The prepared tree of the agent workloads and what they install from.

    ``tree``: ``repo/`` (a clone of :func:`django_repo`, the newest release checked out) and
    ``web/`` (``package.json`` and ``package-lock.json`` of :func:`npm_project`), each only
    when it could be made; ``wheels``, ``npm_cache``: None when absent; ``changed_files``:
    files that differ between the first and the last release; ``missing``: input ->
    why it is absent."""

    tree: Tree
    wheels: Path | None
    npm_cache: Path | None
    changed_files: int
    missing: dict[str, str]


def prepare(dest: Path, cache: Path) -> AgentInputs:
    """Make the inputs (downloads only what the cache lacks) and the tree at ``dest``."""
    _say(f"making the agent tree at {dest} from {cache} (downloading what it lacks)")
    missing: dict[str, str] = {}
    dest.mkdir(parents=True)
    (dest / "README").write_text("The prepared tree of the rametfs agent workloads.\n")
    changed = 0
    try:
        repo = django_repo(cache)
        git("clone", "-q", "--no-hardlinks", str(repo), "repo", cwd=dest)
        changed = len(subprocess.run(
            ["git", "diff", "--name-only", OLD_REVISION, "main"], cwd=dest / "repo",
            env={**os.environ, **GIT_ENV}, capture_output=True, text=True,
            check=True).stdout.splitlines())
    except Unsupported as exc:
        missing["repo"] = str(exc)
    try:
        wheel_dir: Path | None = wheels(cache)
    except Unsupported as exc:
        missing["wheels"], wheel_dir = str(exc), None
    try:
        project, npm_cache = npm_project(cache)
        shutil.copytree(project, dest / "web")
    except Unsupported as exc:
        missing["npm"], npm_cache = str(exc), None
    for what, why in missing.items():
        _say(f"no {what}: {why}")
    return AgentInputs(scan(dest.name, dest), wheel_dir, npm_cache, changed, missing)
