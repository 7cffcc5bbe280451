"""A job directory's lock: one process runs a job in a directory at a time.

A sweep re-run after only its launcher died (its jobs' processes still running) would otherwise start
a second copy of a running job in the same directory: interleaved metrics.jsonl, a summary of a
third of the real throughput. The job process holds `job.lock` (its host, pid and the pid's start
time) from before its first file is written until it ends; a lock whose process is gone (killed,
the machine rebooted) is stale and taken over.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Optional

LOCK_NAME = "job.lock"


class JobLockedError(RuntimeError):
    """The job's directory is locked by a live process: the job runs there already."""


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux): tells a live pid from a reused one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def holder(job_dir: Path) -> Optional[dict]:
    """Who holds the lock of `job_dir` and is still alive; None when unlocked or the lock is stale.
    A lock of another host cannot be checked and counts as held (delete job.lock if no job runs)."""
    try:
        owner = json.loads((Path(job_dir) / LOCK_NAME).read_text())
        pid = int(owner["pid"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None  # half-written or garbage: no process can be shown to hold it
    if owner.get("host") != socket.gethostname():
        return owner
    if pid <= 0 or isinstance(owner["pid"], bool):
        return None  # 0 and -N name process groups (os.kill would signal them), not a job's process
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # OverflowError: a pid no OS has
        return None
    except PermissionError:
        pass  # alive, another user's
    start = _start_time(pid)
    if owner.get("start") is not None and start is not None and start != owner["start"]:
        return None  # the pid was reused by another process
    return owner


class JobLock:
    """`with JobLock(job_dir):` holds the directory's lock, or raises JobLockedError naming the holder."""

    def __init__(self, job_dir: str | Path):
        self.path = Path(job_dir) / LOCK_NAME
        self.held = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # a stale lock is removed once, then taken atomically
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = holder(self.path.parent)
                if owner is not None:
                    raise JobLockedError(
                        f"{self.path.parent} is in use by process {owner.get('pid')} on {owner.get('host')} "
                        f"(its {LOCK_NAME}): the job runs there already. Wait for it, or stop it; delete "
                        f"{self.path} only if no such process runs") from None
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(_me(), f)
            self.held = True
            return
        raise JobLockedError(f"{self.path}: another process took the lock at the same moment")

    def release(self) -> None:
        if self.held:
            self.held = False
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> "JobLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
