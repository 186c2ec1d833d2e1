"""Writes that cannot be redirected, private directories and private scratch.

On a Slurm cluster the submit directory, ``slurm_logs/``, the run directory's parents and node-local
``/tmp`` are shared with other users. Everything the job and its tools write goes through this module:

- directories are created 0700 (less whatever the umask removes) and, when they already exist, must be
  real directories owned by the user and not writable by group or others (``private_dir``);
- a file is replaced through a temp file of unpredictable name created with ``O_EXCL | O_NOFOLLOW``
  and renamed over the target (``write_atomic``), so a symlink planted at the target or at a
  guessable temp name is replaced or refused, never followed;
- new files (``open_new``) and appended files (``open_append``) are opened without following a
  symlink; an appended file must be the user's own;
- trees are copied without following symlinks (``copy_tree``);
- the process umask comes from ``run.umask`` (``apply_umask``).

Standard library only: every layer may import it.
"""

from __future__ import annotations

import errno
import glob
import os
import pwd
import secrets
import stat
import sys
from pathlib import Path
from typing import IO, Any, Callable

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Group or others may write: the directory's entries could be swapped under us.
_FOREIGN_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafePathError(Exception):
    """A path the job was about to write through is not private to the user; str is one line."""


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:                      # a uid with no passwd entry (containers)
        return f"uid{os.geteuid()}"


def _check_dir(path: Path, what: str) -> None:
    """Refuse a directory someone else could redirect: a symlink, not ours, or writable by others."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafePathError(f"{what} {path}: vanished while being created") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{what} {path}: a symlink, not a directory (remove it or choose another path)")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{what} {path}: exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafePathError(f"{what} {path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
                              f"someone else may have created it")
    if st.st_mode & _FOREIGN_WRITE:
        raise UnsafePathError(f"{what} {path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                              f"run chmod go-w on it")


def private_dir(path: str | os.PathLike, *, what: str) -> Path:
    """Create ``path`` (and its missing parents) with mode 0700, or check the existing one.

    Only the directory itself is checked when it exists: its parents may legitimately be shared
    (``/tmp``, a group project directory) or reached through a symlink (``/scratch``). Parents this call
    creates are 0700 too. ``what`` names the directory in the error (``run directory``)."""
    path = Path(path)
    missing = []
    p = path
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)            # the umask can only narrow it
        except FileExistsError:           # created meanwhile, by another rank or someone else: checked below
            pass
    _check_dir(path, what)
    return path


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _temp_beside(path: Path, perms: int) -> tuple[Path, int]:
    """A new file of unpredictable name in ``path``'s directory, created exclusively."""
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            return tmp, os.open(tmp, _CREATE, perms)
        except FileExistsError:           # 64 random bits taken: someone is guessing; try another
            continue
    raise UnsafePathError(f"{path}: could not create a temp file beside it (every name taken)")


def _replace(path: Path, perms: int, write: Callable[[int], None]) -> None:
    """Write a temp file beside ``path`` through ``write(fd)`` and rename it onto ``path``; on any failure
    the temp file goes and ``path`` is as it was."""
    tmp, fd = _temp_beside(path, perms)
    try:
        try:
            write(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_atomic(path: str | os.PathLike, data: str | bytes, *, mode: int = 0o600, fsync: bool = False) -> None:
    """Replace ``path`` by ``data`` (str is written as UTF-8): a reader sees the old file or the new one.

    A symlink at ``path`` is replaced by the file, never followed. With ``fsync`` the file and its
    directory are synced, so the rename survives a crash of the node."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else bytes(data)

    def write(fd: int) -> None:
        _write_all(fd, raw)
        if fsync:
            os.fsync(fd)

    _replace(path, mode, write)
    if fsync:
        fsync_dir(path.parent)


def fsync_dir(directory: str | os.PathLike) -> None:
    """Sync a directory, so that a rename inside it is durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP):    # file systems that cannot sync a directory
            raise
    finally:
        os.close(fd)


def open_new(path: str | os.PathLike, mode: str = "w", *, perms: int = 0o600, **kwargs: Any) -> IO[Any]:
    """Open a file that must not exist yet (``O_EXCL | O_NOFOLLOW``) for writing.

    ``mode`` is ``"w"`` or ``"wb"`` (``"x"``/``"xb"`` alike); ``kwargs`` go to ``open`` (buffering,
    encoding). An existing file raises FileExistsError; a symlink there raises UnsafePathError."""
    path = Path(path)
    if mode.replace("x", "w") not in ("w", "wb", "wt"):
        raise ValueError(f"open_new {path}: mode {mode!r} is not a write mode (w, wb)")
    try:
        fd = os.open(path, _CREATE, perms)
    except FileExistsError:
        if os.path.islink(path):
            raise UnsafePathError(f"{path}: a symlink (refusing to write through it)") from None
        raise
    return os.fdopen(fd, mode.replace("x", "w"), **kwargs)


def open_append(path: str | os.PathLike, *, perms: int = 0o600, mode: str = "a", **kwargs: Any) -> IO[Any]:
    """Open ``path`` for appending, creating it if missing, without following a symlink.

    An existing file must be a regular file owned by the user: appending to someone else's file
    (planted in a shared directory) would hand them our lines. ``mode`` is ``"a"`` or ``"ab"``."""
    path = Path(path)
    if mode not in ("a", "ab", "at"):
        raise ValueError(f"open_append {path}: mode {mode!r} is not an append mode (a, ab)")
    try:
        # O_NONBLOCK: a FIFO planted there fails to open instead of blocking until someone reads it.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                     perms)
    except OSError:
        if os.path.islink(path):
            raise UnsafePathError(f"{path}: a symlink (refusing to append through it)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path}: not a regular file (refusing to append to it)")
        if st.st_uid != os.geteuid():
            raise UnsafePathError(f"{path}: owned by uid {st.st_uid}, not by you (uid {os.geteuid()}); "
                                  f"refusing to append to it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the directory tree ``src`` into ``dst`` (created private, or checked, as ``private_dir``).

    Only directories and regular files are copied, never through a symlink. A symlink or special
    file inside ``src`` raises UnsafePathError rather than being skipped: the trees copied (a rank's
    shards) never hold one, so one there was planted, and skipping it would leave a manifest naming a
    file that is not there, an error far from its cause. The tree is checked in full before anything
    is copied; a file swapped for a symlink meanwhile fails its ``O_NOFOLLOW`` open. Each file is
    written as ``write_atomic`` does, so an existing file in ``dst`` is replaced, not written through."""
    src, dst = Path(src), Path(dst)
    plan: list[tuple[Path, bool]] = []          # (path relative to src, is a directory)
    st = os.lstat(src)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"copy source {src}: {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}")
    for root, dirs, files in os.walk(src, followlinks=False):
        base = Path(root).relative_to(src)
        for name in sorted(dirs + files):
            p = Path(root) / name
            mode = os.lstat(p).st_mode
            if stat.S_ISLNK(mode):
                raise UnsafePathError(f"copy source {p}: a symlink (the tree must hold only files and directories)")
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise UnsafePathError(f"copy source {p}: not a regular file or directory")
            plan.append((base / name, stat.S_ISDIR(mode)))
    private_dir(dst, what="copy destination")
    for rel, is_dir in sorted(plan):
        if is_dir:
            private_dir(dst / rel, what="copy destination")
        else:
            _copy_file(src / rel, dst / rel)


def _copy_file(src: Path, dst: Path) -> None:
    try:
        fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        if os.path.islink(src):
            raise UnsafePathError(f"copy source {src}: a symlink (the tree must hold only files and "
                                  f"directories)") from None
        raise
    try:
        st = os.fstat(fin)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"copy source {src}: not a regular file")

        def copy(fout: int) -> None:
            while chunk := os.read(fin, 1 << 20):
                _write_all(fout, chunk)
            os.utime(fout, ns=(st.st_atime_ns, st.st_mtime_ns))

        _replace(dst, 0o600, copy)
    finally:
        os.close(fin)


def parse_umask(value: str) -> int:
    """``run.umask`` as a number: octal digits (``"077"``, ``"0o027"``), at most 0o777."""
    text = value.strip()
    digits = text[2:] if text[:2] in ("0o", "0O") else text
    if not digits or len(digits) > 4 or any(c not in "01234567" for c in digits) or int(digits, 8) > 0o777:
        raise ValueError(f"run.umask = {value!r}: not an octal umask between 000 and 777")
    return int(digits, 8)


def apply_umask(cfg_umask: str) -> int:
    """Set the process umask from ``run.umask``; returns the previous one."""
    return os.umask(parse_umask(cfg_umask))


def private_scratch(root: str | os.PathLike, prefix: str) -> Path:
    """This user's scratch directory ``<root>/<prefix>-<user>``, created 0700 or checked as ``private_dir``.

    The name is predictable on purpose: node-local scratch must be found again after a requeue of the
    same job on the same node (same ``prefix``, which carries the Slurm job id) so that a rank resumes
    from its own shards; a random name (``mkdtemp``) would lose them. The user in the name keeps two
    users of one run name apart when there is no job id.

    Predictable names can be taken: when someone else holds it (a symlink, another owner, writable by
    others), nothing is written there. The rank uses a private directory of its own,
    ``<root>/<prefix>-<user>.<random>``, says so in one line on stderr, and finds that one again after a
    requeue: only a directory of ours that passes the check is reused, so planting more names cannot
    redirect it either."""
    root = Path(root)
    name = f"{prefix}-{_user()}"
    try:
        return private_dir(root / name, what="scratch directory")
    except UnsafePathError as err:
        taken = err
    for p in sorted(root.glob(glob.escape(name) + ".*")):      # our fallback of before a requeue
        try:
            _check_dir(p, "scratch directory")
        except UnsafePathError:
            continue
        print(f"reflow_hpc: {taken}; using {p}", file=sys.stderr, flush=True)
        return p
    for _ in range(16):
        p = root / f"{name}.{secrets.token_hex(8)}"
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue
        _check_dir(p, "scratch directory")
        print(f"reflow_hpc: {taken}; using {p} instead", file=sys.stderr, flush=True)
        return p
    raise UnsafePathError(f"scratch directory {root / name}: taken, and no private one could be made beside it")
