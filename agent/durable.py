"""Writes that survive a power cut, not only a crash: the data fsynced, then renamed, then the directory fsynced.

rename(2) makes a swap atomic against this process dying; it does not make it durable. ext4's delayed
allocation can commit a rename before the data of the files renamed, so after a power cut an update the
fleet was told had succeeded could hold zero-length files (the boot check then falls back to `previous`,
and the fleet's record is wrong), and a journal replaced by rename could read back empty. Edge boxes lose
power; so every install, link swap and journal write here is synced before it is reported.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync one file or directory (a directory's fsync makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: Path) -> None:
    """fsync every file and directory under root, root included (directories after what they hold)."""
    root = Path(root)
    for here, dirs, files in os.walk(root, topdown=False):
        for name in files:
            p = Path(here) / name
            if not p.is_symlink():
                fsync_path(p)
        fsync_path(Path(here))


def move_into_place(tmp: Path, dest: Path) -> None:
    """Rename a finished file or directory tree onto dest (which must not be a non-empty directory), durably."""
    tmp, dest = Path(tmp), Path(dest)
    sync_tree(tmp) if tmp.is_dir() else fsync_path(tmp)
    os.replace(tmp, dest)
    fsync_path(dest.parent)


def replace_tree(tmp: Path, dest: Path, aside: Path) -> None:
    """Put the finished directory tmp at dest, durably; an existing dest (rename cannot replace a full
    directory) is renamed to `aside` and deleted after. tmp is synced first, so dest is missing only
    between two renames: synced after the move aside, a build interrupted while hundreds of MB were
    written out left no bundle at all. If the second rename fails, the old dest is put back.

    Interrupted anywhere (Ctrl-C), dest holds the old tree or the new one, never neither: both renames are
    inside the recovery, and it puts the old tree back only while dest is missing."""
    tmp, dest = Path(tmp), Path(dest)
    sync_tree(tmp)
    moved = _exists(dest)
    try:
        if moved:
            os.replace(dest, aside)
        os.replace(tmp, dest)
    except BaseException:
        if moved and not _exists(dest) and _exists(aside):  # the new tree never arrived: the old one goes back
            os.replace(aside, dest)
        raise
    fsync_path(dest.parent)
    if moved:
        shutil.rmtree(aside, ignore_errors=True)


def _exists(path: Path) -> bool:
    return path.exists() or path.is_symlink()


def write_text(path: Path, text: str) -> None:
    """Replace path's content with text: a reader, or the file after a power cut, sees the old or the new."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise _naming(e, path) from e
    finally:
        tmp.unlink(missing_ok=True)  # a full disk left a stray partial file beside the old one
    fsync_path(path.parent)


def _naming(e: OSError, path: Path) -> OSError:
    """The error with the path the caller asked for, not our temporary name (which meant nothing to a user)."""
    return type(e)(e.errno, e.strerror, str(path))


def create_new(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Create path holding data, durably, or raise FileExistsError: never a partial file under its name.

    Written to a temporary name first and hard-linked into place, which fails rather than replace a file
    that appeared meanwhile (a signing key must never be overwritten)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)  # the mode from the start: a key is
        with os.fdopen(fd, "wb") as f:                                 # never readable by others, even briefly
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP):
                raise
            # no hard links (vfat or exFAT: a USB stick, a common home for a signing key): check, then rename
            if path.exists():
                raise FileExistsError(errno.EEXIST, "File exists", str(path)) from None
            os.rename(tmp, path)
        fsync_path(path.parent)
    except OSError as e:
        raise _naming(e, path) from e
    finally:
        tmp.unlink(missing_ok=True)
