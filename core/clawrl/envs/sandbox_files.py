"""Host-side access to a sandbox's writable tree that a symlink inside it cannot redirect.

clawrl reads and writes sandbox files from the host (as root, usually), while the sandboxed process
owns those directories and may have planted symlinks: ``/app/out -> /etc/shadow`` must read the
sandbox's idea of ``/etc/shadow`` (refused: not a writable place), never the host's. So every path is
resolved the way the sandbox's kernel would (absolute links restart at the sandbox's "/"), and every
component is opened with O_NOFOLLOW relative to its parent's descriptor, so a link swapped in between
the resolving and the opening fails instead of being followed.
"""
from __future__ import annotations

import errno
import os
import stat
from collections import deque
from typing import Callable, Optional

MAX_LINK_HOPS = 40  # what Linux allows for one path


class UnsafePath(OSError):
    """A path that leaves the writable tree, loops, or changed while it was opened."""


def _open_dir(root_fd: int, parts: list[str], create: bool, chown: Optional[Callable[[int], None]]) -> int:
    """A descriptor of root/parts..., each component opened without following links; missing
    directories are created (and handed to ``chown``) when ``create``."""
    fd = os.dup(root_fd)
    try:
        for name in parts:
            try:
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                if chown is not None:
                    chown(nfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):  # a link appeared, or a file
                    raise UnsafePath(f"{name!r} is not a directory (or changed while opening)") from e
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def resolve(root_fd: int, path: str) -> list[str]:
    """The components of in-sandbox ``path`` with every symlink resolved inside the sandbox's tree
    (``..`` never climbs above its "/"). The last component may be missing; a missing directory on
    the way ends resolution (the rest is taken literally, to be created)."""
    pending = deque(path.split("/"))
    resolved: list[str] = []
    hops = 0
    while pending:
        name = pending.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            if resolved:
                resolved.pop()
            continue
        try:
            dfd = _open_dir(root_fd, resolved, create=False, chown=None)
        except FileNotFoundError:
            resolved.append(name)
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        else:
            if stat.S_ISLNK(st.st_mode):
                hops += 1
                if hops > MAX_LINK_HOPS:
                    raise UnsafePath(f"too many symbolic links in {path}")
                target = os.readlink(name, dir_fd=dfd)
                if target.startswith("/"):
                    resolved = []
                pending.extendleft(reversed(target.split("/")))
                continue
        finally:
            os.close(dfd)
        resolved.append(name)
    return resolved


def open_beneath(root_fd: int, parts: list[str], flags: int, mode: int = 0o644,
                 chown: Optional[Callable[[int], None]] = None) -> int:
    """Open the already-resolved ``parts`` beneath ``root_fd`` (O_NOFOLLOW at every step); with
    O_CREAT, missing parent directories are created too and everything new goes to ``chown``."""
    if not parts:
        raise UnsafePath("the sandbox's / itself is not a file")
    create = bool(flags & os.O_CREAT)
    dfd = _open_dir(root_fd, parts[:-1], create=create, chown=chown)
    try:
        try:
            existed = True
            os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            existed = False
        try:
            fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:  # a link appeared after resolving
                raise UnsafePath(f"{parts[-1]!r} changed into a link while opening") from e
            raise
        if create and not existed and chown is not None:
            chown(fd)
        return fd
    finally:
        os.close(dfd)


def make_dirs(root_fd: int, parts: list[str], chown: Optional[Callable[[int], None]] = None) -> None:
    """mkdir -p of resolved ``parts`` beneath ``root_fd``, new directories handed to ``chown``."""
    os.close(_open_dir(root_fd, parts, create=True, chown=chown))
