"""The run directory: the one place that knows its layout, and the only way ranktop writes there.

    <log root>/<run id>/events.jsonl
                       /attempt_<k>/<local rank>/stdout.log, stderr.log, error.json
                       /stacks/<timestamp>.txt, .json

ranktop often runs as root under a shared /tmp. A path can be swapped between two uses of it (a
directory renamed, a symlink planted), so every directory here is opened once, with
O_NOFOLLOW, and held; what lies beneath is made and opened relative to a held descriptor, never
by path, and never through a symlink. Directories are 0700, files 0600, like mkdtemp's. Paths
are still kept, but only to tell people where things are.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import os
import re
import stat
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

from ranktop.core.errors import UsageError
from ranktop.core.sanitize import quoted

EVENTS = "events.jsonl"
STACKS = "stacks"
STDOUT_LOG = "stdout.log"
STDERR_LOG = "stderr.log"
ERROR_FILE = "error.json"
FINAL_FILE = "final.json"  # the run's last snapshot, for `ranktop attach` after its engine left
FINAL_KEY = "final_key"  # final.json's field holding the secret whose sha256 is the run's final_seal


def final_seal_of(key: str) -> str:
    """The seal (public) of a final.json key (secret): its sha256, in hex."""
    return _sha256(key.encode()).hexdigest()


def _sha256_here():
    """Python's own sha256: hashlib's loads OpenSSL's libcrypto, 4 MB more of every engine's RSS."""
    try:
        from _sha256 import sha256  # (3.10, 3.11)
    except ImportError:
        try:
            from _sha2 import sha256  # (3.12 on)
        except ImportError:
            from hashlib import sha256
    return sha256


_sha256 = _sha256_here()

DIR_MODE = 0o700
FILE_MODE = 0o600

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted in a log file's place must not wait for a reader.
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# What opening a non-directory (or a symlink) as a directory, or a non-file as a file, fails with.
_NOT_OURS = (errno.ELOOP, errno.ENOTDIR, errno.ENXIO, errno.EISDIR, errno.EEXIST)


def attempt_name(attempt: int, start: int = 0) -> str:
    """attempt_<k>; a later start of the same attempt (nodes joined a rendezvous run, no restart
    spent) is attempt_<k>.<start>."""
    return f"attempt_{attempt}" + (f".{start}" if start else "")


def log_name(stream: int) -> str:
    """The log file of stream 1 (stdout) or 2 (stderr)."""
    return STDOUT_LOG if stream == 1 else STDERR_LOG


def dump_log_path(rank_dir: str) -> str:
    """The log a rank's SIGUSR1 stack dump lands in: faulthandler writes to stderr, which is
    stderr.log, except with --pty, where stderr shares the terminal with stdout and there is no
    stderr.log (ranktop writes one at every start otherwise)."""
    stderr_log = os.path.join(rank_dir, STDERR_LOG)
    return stderr_log if os.path.lexists(stderr_log) else os.path.join(rank_dir, STDOUT_LOG)


def check_run_id(run_id: str, flag: str = "--run-id") -> str:
    """A run id names one directory under the log root: no separators, no '..', nothing
    unprintable. `flag`: the option it came from, for the message (a rendezvous id is one too)."""
    why = _run_id_problem(run_id)
    if why is not None:
        raise UsageError(f"bad {flag} {quoted(run_id[:80])}: {why} (a run id names its run directory: printable "
                         "characters other than '/', and not '.' or '..'; e.g. exp-1)")
    return run_id


def _run_id_problem(run_id: str) -> str | None:
    if not run_id:
        return "it is empty"
    if "/" in run_id:
        return "it contains '/'"
    if run_id in (".", ".."):
        return "it is the name of the current or parent directory"
    odd = next((char for char in run_id if not char.isprintable()), None)
    if odd is not None:
        return f"it contains {_unprintable(odd)}"
    if len(run_id.encode(errors="surrogateescape")) > MAX_RUN_ID_BYTES:
        return f"it is longer than {MAX_RUN_ID_BYTES} bytes"
    return None


def _unprintable(char: str) -> str:
    """A character a run id may not hold, told apart: quoted, a no-break space looks like a space
    and a zero-width one like nothing, and a byte the file system's encoding does not read is no
    control character (each was 'a control character')."""
    import unicodedata  # (only for this message)

    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # such a byte of the command line, as Python holds it (surrogateescape)
        return f"the byte \\x{code - 0xDC00:02x}, which is not {sys.getfilesystemencoding()} text"
    if unicodedata.category(char) == "Cc":
        return f"a control character (U+{code:04X})"
    return f"U+{code:04X} ({unicodedata.name(char, 'unassigned')}), which is not printable"


MAX_RUN_ID_BYTES = 200  # a file name holds 255, and nodes sharing a log dir add '.N' to it


class Dir:
    """A directory held open: `path` is for people, `fd` is what ranktop uses.

    Held across threads (a stack dump on a server thread saves into the run directory while the
    engine thread ends the run and closes it), so every use of the descriptor and its closing
    take one lock: a number closed under a user could be the kernel's next file or directory, and
    the write would land there."""

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd
        self._lock = threading.RLock()

    @property
    def fd(self) -> int:
        """The descriptor, -1 once closed; where another thread may close it, `use()` holds it open."""
        return self._fd

    @contextlib.contextmanager
    def use(self) -> Iterator[int]:
        """The descriptor, kept open while the caller uses it (close() waits); EBADF once closed."""
        with self._lock:
            if self._fd < 0:
                raise OSError(errno.EBADF, f"{self.path} is closed")
            yield self._fd

    def sub(self, name: str) -> Dir:
        """The sub-directory `name`, made (0700) unless there. Whatever else is there under that
        name (a symlink, a file) is set aside first: we never follow it."""
        with self.use() as fd:
            try:
                os.mkdir(name, DIR_MODE, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                held = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in _NOT_OURS:
                    raise
                self.set_aside(name)
                os.mkdir(name, DIR_MODE, dir_fd=fd)
                held = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        return Dir(os.path.join(self.path, name), held)

    def fresh(self, prefix: str) -> str:
        """The name of a new directory `prefix`<random> made here (0700), as mkdtemp makes one."""
        with self.use() as fd:
            while True:
                name = prefix + os.urandom(4).hex()
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=fd)
                    return name
                except FileExistsError:
                    continue

    def open_append(self, name: str) -> int:
        """`name` opened for appending (made 0600 unless there). Anything there but a plain file
        of ours (a symlink, a FIFO, a hard link to a file elsewhere) is set aside for a new file."""
        with self.use() as dir_fd:
            try:
                fd = os.open(name, _APPEND_FLAGS, FILE_MODE, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno not in _NOT_OURS:
                    raise
            else:
                info = os.fstat(fd)
                if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:
                    return fd
                os.close(fd)
            self.set_aside(name)
            return os.open(name, _APPEND_FLAGS | os.O_EXCL, FILE_MODE, dir_fd=dir_fd)

    def open_new(self, name: str) -> int:
        """A new file `name` (0600) opened for writing; fails if anything has that name."""
        with self.use() as fd:
            return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                           FILE_MODE, dir_fd=fd)

    def remove(self, name: str) -> None:
        """Remove the entry `name` if there (a symlink itself, never what it points to)."""
        with self.use() as fd:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                pass
            except (IsADirectoryError, PermissionError):
                self.set_aside(name)

    def rename(self, name: str, new_name: str) -> None:
        """Rename the entry `name` to `new_name`, replacing whatever has that name (at once)."""
        with self.use() as fd:
            os.rename(name, new_name, src_dir_fd=fd, dst_dir_fd=fd)

    def set_aside(self, name: str) -> None:
        """Move what is called `name` out of the way (kept, renamed), if anything is."""
        with self.use() as fd:
            try:
                os.rename(name, f"{name}.set-aside-{os.urandom(4).hex()}", src_dir_fd=fd, dst_dir_fd=fd)
            except FileNotFoundError:
                pass

    def entries(self) -> list[str]:
        with self.use() as fd:
            return os.listdir(fd)

    def path_of(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class UnmadeDir(Dir):
    """A directory that could not be made (a full disk, out of inodes; its parent removed under
    the run): every use fails with that error, so each file meant for it is a write that failed,
    reported as a full disk midway is, rather than an exception out of the run."""

    def __init__(self, path: str, error: OSError):
        super().__init__(path, -1)
        self._error = error

    @contextlib.contextmanager
    def use(self) -> Iterator[int]:
        raise OSError(self._error.errno, self._error.strerror)
        yield -1  # (a generator, as Dir.use is)


class RunDir(Dir):
    """One run's directory, created fresh (never reused) and held from the moment the run begins."""

    @classmethod
    def create(cls, log_dir: str | None, run_id: str, numbered: bool = False, *,
               log_dir_name: str = "--log-dir") -> RunDir:
        """<log root>/<run_id>, made private and exclusively; UsageError (one line) if it cannot be.
        `numbered`: when taken, <run_id>.1, <run_id>.2, ... instead (a rendezvous id, the same on
        every node, where nodes share a file system or the job runs again). `log_dir_name`: what
        the caller calls `log_dir` (the Python API's `log_dir`), for the message."""
        check_run_id(run_id)
        root = open_log_root(log_dir, log_dir_name)
        try:
            name = cls._make(root, run_id, numbered)
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=root.fd)
        except FileExistsError:
            raise UsageError(f"run directory {root.path_of(run_id)} already exists: pick another --run-id") from None
        except OSError as exc:
            raise UsageError(f"bad {log_dir_name} {root.path}: cannot write there ({exc.strerror})") from None
        finally:
            root.close()
        return cls(root.path_of(name), fd)

    @staticmethod
    def _make(root: Dir, run_id: str, numbered: bool) -> str:
        for n in range(10_000 if numbered else 1):
            name = f"{run_id}.{n}" if n else run_id
            try:
                os.mkdir(name, DIR_MODE, dir_fd=root.fd)  # atomic: two nodes never get the same one
                return name
            except FileExistsError:
                continue
        raise FileExistsError(run_id)

    @classmethod
    def adopt(cls, path: str) -> RunDir:
        """An existing, empty directory the caller gave us (start_processes' log_dir), reached as
        a --log-dir is (`open_chosen_dir`); UsageError, a ValueError, says why not."""
        held = open_chosen_dir(path, "log_dir", make=False)
        if os.listdir(held.fd):
            held.close()
            raise ValueError(f"log_dir {quoted(path)} is not empty; give each run an empty directory")
        return cls(held.path, held.fd)

    @classmethod
    def open_existing(cls, path: str) -> RunDir:
        """A run directory another ranktop made (for `ranktop stacks`), reached as a --log-dir is
        (`open_chosen_dir`), nothing made; it must be as ranktop makes one: ours and private
        (anyone else's, or one others may write, gets no dump of ours). UsageError says why not."""
        held = open_chosen_dir(path, "run directory", make=False, shared_ok=False,
                               advice="the dump is shown, not saved", room_below=0)
        return cls(held.path, held.fd)

    def attempt(self, attempt: int, start: int = 0) -> Dir:
        return self.sub(attempt_name(attempt, start))

    def attempt_path(self, attempt: int, start: int = 0) -> str:
        return self.path_of(attempt_name(attempt, start))

    def stacks(self) -> Dir:
        return self.sub(STACKS)

    def open_events(self, create: bool = True) -> int | None:
        """events.jsonl for appending; without `create`, None unless it is there (another process's)."""
        if create:
            return self.open_append(EVENTS)
        try:
            with self.use() as dir_fd:
                fd = os.open(EVENTS, _APPEND_FLAGS & ~os.O_CREAT, dir_fd=dir_fd)
        except OSError:
            return None
        info = os.fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1:  # not a hard link to a file elsewhere
            return fd
        os.close(fd)
        return None


def tail_lines(path: str, max_bytes: int, *, dir_fd: int | None = None) -> list[bytes]:
    """The last `max_bytes` of a log file as lines (a cut first line dropped); [] when it cannot
    be read. A rank can plant anything in its own directory: a symlink or a FIFO in place of its
    log is not followed or waited on, only a regular file is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return []
        f.seek(max(0, info.st_size - max_bytes))
        data = f.read(max_bytes)
    lines = data.split(b"\n")
    if info.st_size > max_bytes:
        lines = lines[1:]
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def tail_lines_below(top: str | int, names: list[str], max_bytes: int) -> list[bytes]:
    """tail_lines of the file that `names` lead to under the directory `top` (a path or a held
    descriptor), no step following a symlink: a rank can swap its own directory for a link to
    anywhere while a view is open."""
    try:
        top_fd = os.open(top, _DIR_FLAGS) if isinstance(top, str) else os.dup(top)
    except OSError:
        return []
    try:
        parent = open_dir_below(top_fd, names[:-1])
    except OSError:
        return []
    finally:
        os.close(top_fd)
    try:
        return tail_lines(names[-1], max_bytes, dir_fd=parent)
    finally:
        os.close(parent)


def open_dir_below(dir_fd: int, names: list[str]) -> int:
    """A new descriptor of the directory `names` lead to from `dir_fd`, each step opened without
    following a symlink."""
    fd = os.dup(dir_fd)
    for name in names:
        try:
            below = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = below
    return fd


def latest_attempt_path(run_dir: str) -> str | None:
    """The newest attempt_<k> directory of a run (for readers outside the run's process)."""
    attempts = [d for d in os.listdir(run_dir) if re.fullmatch(r"attempt_\d+(\.\d+)?", d)]
    return os.path.join(run_dir, max(attempts, key=_attempt_order)) if attempts else None


def _attempt_order(name: str) -> tuple[int, ...]:
    return tuple(int(part) for part in name.removeprefix("attempt_").split("."))


def run_dir_of_error_file(path: str) -> str:
    """TORCHELASTIC_ERROR_FILE is <run dir>/attempt_<k>/<local rank>/error.json."""
    return os.path.dirname(os.path.dirname(os.path.dirname(path)))


# ----- the log root ---------------------------------------------------------------------------
def temp_dir() -> str:
    """$TMPDIR as tempfile chooses it, made absolute: TMPDIR=. stays '.' there, which a walk from
    `/` (`_walk`) took for `/` itself, and whose paths meant another directory from another one."""
    return os.path.abspath(tempfile.gettempdir())


def default_log_root() -> str:
    return os.path.join(temp_dir(), f"ranktop-{os.geteuid()}")


def open_log_root(log_dir: str | None, log_dir_name: str = "--log-dir") -> Dir:
    """The directory that holds run directories, opened and checked; UsageError says why not.

    The default root under the shared temp directory must be ours alone: not a symlink, owned by
    us, writable by no one else (anyone who could rename things in it could point a later run's
    paths elsewhere). A --log-dir the user named is followed through symlinks (they chose it) and
    may be shared the way /tmp is (writable by all with the sticky bit: no one can rename our
    run directory there), but not writable by others without the sticky bit, nor owned by another
    user (root aside). An empty one (`--log_dir=$LOG_DIR`, unset) is none, as torch reads it: as a
    path it named the current directory."""
    if not log_dir:
        return _open_default_root(default_log_root())
    return open_chosen_dir(log_dir, log_dir_name, make=True)


def _open_default_root(path: str) -> Dir:
    """The root `path`, made and opened in its directory ($TMPDIR), which is walked to as a
    --log-dir is: with $TMPDIR another user's (kept over `sudo -E`), they could swap our private
    root for a tree of theirs, and the ranks open $TORCHELASTIC_ERROR_FILE by path."""
    tmp, name = os.path.split(path)
    try:
        parent = _walk_into(tmp)
    except _Refused as exc:
        raise UsageError(f"log root {path}: {exc}; {SET_TMPDIR}, or pass --log-dir DIR") from None
    except OSError as exc:
        raise UsageError(f"cannot make the log root {path} ({exc.strerror}): pass --log-dir DIR") from None
    try:
        return _open_root_in(parent, name, path)
    finally:
        os.close(parent)


SET_TMPDIR = "set TMPDIR to a directory of your own"

MAX_ROOT_ENTRIES = 10_000  # entries of the log root looked at for its ended runs: bounded work for any root
MAX_RUNS_OPENED = 32  # of those, the directories changed last, opened to look for their final.json


def newest_ended_runs(count: int) -> list[tuple[str, float]]:
    """(name, when its final.json was written) of the `count` runs under the default log root
    that ended last, newest first, for a user who comes back after the engine left. Read, never
    made: [] unless the root is there and as ranktop makes it (`_open_default_root`'s rule); only
    our own directories, none reached through a symlink, whose final.json is the engine's
    (`_sealed_end`). An ended run's directory changed last when its final.json was made, so only
    the MAX_RUNS_OPENED changed last are opened."""
    with _default_root_read() as root:
        if root is None:
            return []
        ended = [(name, when) for name in _newest_dirs(root, MAX_RUNS_OPENED)
                 if (when := _sealed_end(root, name)) is not None]
    return sorted(ended, key=lambda run: run[1], reverse=True)[:count]


def default_run_files(name: str) -> frozenset[str]:
    """Which of final.json and events.jsonl the run `name` under the default log root holds, read
    as `newest_ended_runs` reads the root (its rule: the root ours and private, the run's
    directory ours and no symlink, the file a plain one of ours): none where the rule fails, for
    a root another user made first could hold any tree they like under our run's id."""
    if "/" in name or name in ("", ".", ".."):
        return frozenset()
    with _default_root_read() as root:
        if root is None:
            return frozenset()
        return frozenset(file for file in (FINAL_FILE, EVENTS) if _own_file_written(root, name, file) is not None)


def ended_runs_starting(prefix: str) -> list[str]:
    """The ids of the ended runs under the default log root that start with `prefix`, sorted,
    read by `newest_ended_runs`' rule ([] where the root fails it), its seal aside: the run a
    prefix names has its final.json opened and checked (`client.FinalEngine`), which says so
    where the engine did not write it, and a prefix may match any number of runs."""
    with _default_root_read() as root:
        if root is None:
            return []
        names = sorted(name for name in os.listdir(root) if name.startswith(prefix))
        return [name for name in names if _own_file_written(root, name, FINAL_FILE) is not None]


@contextlib.contextmanager
def _default_root_read() -> Iterator[int | None]:
    """A descriptor of the default log root to read, closed on leaving, or None: missing, or not
    ours alone (the way to it, or the root itself, someone else controls), which has no runs of
    ours to name."""
    fd = _default_root_to_read()[0]
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def default_root_problem() -> str | None:
    """Why the default log root is not read for runs of ours (someone else controls it or the
    way to it), in words that follow its path (`is a symlink`, `: it goes through ...`); None
    where it is read, or missing."""
    fd, problem = _default_root_to_read()
    if fd is not None:
        os.close(fd)
    return problem


def _default_root_to_read() -> tuple[int | None, str | None]:
    """(a descriptor of the default log root, None), or (None, why it is not read: None if missing)."""
    tmp, name = os.path.split(default_log_root())
    try:
        parent = _walk_into(tmp)
    except _Refused as exc:
        return None, f": {exc}"
    except OSError:
        return None, None
    try:
        fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        link = exc.errno != errno.ENOENT and _is_link(name, parent)
        return None, " is a symlink" if link else None
    finally:
        os.close(parent)
    if problem := _root_problem(os.fstat(fd), allow_sticky=False):
        os.close(fd)
        return None, f" {problem}"
    return fd, None


def newest_entries(root: int | str, count: int, key: Callable[[os.DirEntry], float | None]) -> list[str]:
    """The names of the `count` entries of the directory `root` (a descriptor or a path) with the
    largest `key` (None: passed over), largest first, among its first MAX_ROOT_ENTRIES entries:
    bounded work however many runs a log root holds. OSError if `root` cannot be listed."""
    with os.scandir(root) as entries:  # (of a descriptor, it reads a duplicate: `root` stays open)
        keyed = [(k, entry.name) for entry in itertools.islice(entries, MAX_ROOT_ENTRIES)
                 if (k := key(entry)) is not None]
    return [name for _, name in heapq.nlargest(count, keyed)]


def _newest_dirs(root: int, count: int) -> list[str]:
    """The names of our `count` directories in `root` changed last (a symlink is no directory here)."""
    return newest_entries(root, count, _own_dir_changed)


def _own_dir_changed(entry: os.DirEntry) -> float | None:
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:  # removed while we look
        return None
    return info.st_mtime if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() else None


def _own_file_written(root: int, name: str, file: str) -> float | None:
    """When the run directory `name`'s `file` (final.json: still running, or its engine was
    killed, without one) was written: a regular file of ours in a directory of ours, reached
    through no symlink; None otherwise."""
    run = _own_run_dir(root, name)
    if run is None:
        return None
    try:
        info = os.stat(file, dir_fd=run, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(run)
    return info.st_mtime if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() else None


def _sealed_end(root: int, name: str) -> float | None:
    """When the run `name` ended: when its engine wrote its final.json (`_own_file_written`'s
    rule), which holds the key to the seal its run_started recorded. None otherwise: the run goes
    on, or its engine was killed before the end, and the final.json there, if any, is one a rank
    planted (a rank of ours can write its run directory). A run with no seal recorded (an older
    ranktop's) is taken as its final.json says, as `client.FinalEngine` takes it. Cheap however
    hostile the files: the first line of events.jsonl and the tail of final.json are read."""
    from ranktop.core.events import recorded_seal  # (events imports this module)

    run = _own_run_dir(root, name)
    if run is None:
        return None
    try:
        fd = os.open(FINAL_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=run)
    except OSError:
        os.close(run)
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        key, seal = _final_key_at_end(fd, info.st_size), recorded_seal(run)
    finally:
        os.close(fd)
        os.close(run)
    return info.st_mtime if seal is None or (key is not None and final_seal_of(key) == seal) else None


def _own_run_dir(root: int, name: str) -> int | None:
    """A descriptor of the directory `name` in `root`, if it is one of ours (no symlink), else None."""
    try:
        run = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=root)
    except OSError:  # swapped for a symlink or a file, or removed, since it was listed
        return None
    try:
        if os.fstat(run).st_uid == os.geteuid():
            return run
    except OSError:
        pass
    os.close(run)
    return None


# The engine writes final.json's key last (core/agent.py, _write_final), as json.dumps lays it out.
_KEY_AT_END = re.compile(rb'"' + FINAL_KEY.encode() + rb'": "([0-9a-f]{1,128})"\}\Z')
_KEY_TAIL = 256  # bytes of final.json that hold its key: `, "final_key": "<32 hex digits>"}`


def _final_key_at_end(fd: int, size: int) -> str | None:
    """The key at the end of the open final.json `fd` of `size` bytes, read from its last bytes
    only (a final.json of thousands of ranks is megabytes, and a rank's can be any size), or None."""
    try:
        tail = os.pread(fd, _KEY_TAIL, max(0, size - _KEY_TAIL))
    except OSError:
        return None
    found = _KEY_AT_END.search(tail)
    return found.group(1).decode() if found else None


def checked_tempdir() -> str:
    """$TMPDIR (tempfile's choice), where function ranks' pickles go, opened by path: UsageError
    (one line) if someone else controls the way there, who could swap our directory for theirs
    and have root unpickle their code."""
    tmp = temp_dir()
    if problem := path_problem(tmp):
        raise UsageError(f"bad $TMPDIR {tmp}: {problem}; {SET_TMPDIR}")
    return tmp


def _open_root_in(parent: int, name: str, path: str) -> Dir:
    try:
        os.mkdir(name, DIR_MODE, dir_fd=parent)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"cannot make the log root {path} ({exc.strerror}): pass --log-dir DIR") from None
    try:
        fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent)
    except OSError as exc:
        # With O_DIRECTORY, a symlink fails as ENOTDIR, not ELOOP: ask what it is.
        what = "a symlink" if _is_link(name, parent) else "not a directory" if exc.errno in _NOT_OURS else None
        if what is None:
            raise UsageError(f"cannot open the log root {path} ({exc.strerror}): pass --log-dir DIR") from None
        raise UsageError(f"log root {path} is {what}; ranktop will not write through it: "
                         f"remove it, or pass --log-dir DIR") from None
    problem = _root_problem(os.fstat(fd), allow_sticky=False)
    if problem:
        os.close(fd)
        raise UsageError(f"log root {path} {problem}, so others could tamper with run logs: "
                         f"remove it (ranktop makes it again, private), or pass --log-dir DIR")
    return Dir(path, fd)


class LogDirNotADirectory(UsageError, NotADirectoryError):
    """A chosen directory that is not one: torch raises NotADirectoryError, ranktop a UsageError."""


PATH_MAX = 4096  # bytes of a path the kernel takes, its NUL included
ROOM_BELOW = 512  # a run's own names below a chosen directory: <run id>.N/attempt_K.N/<rank>/filtered_stderr.log...


def open_chosen_dir(path: str, what: str, *, make: bool, shared_ok: bool = True, advice: str | None = None,
                    room_below: int = ROOM_BELOW) -> Dir:
    """The directory at `path`, which someone chose (a --log-dir, an API's log_dir, a run
    directory to save a dump in), walked to from `/` and held (`_walk`); what is missing made
    (0700 each) with `make`, else refused. It must be ours or root's and writable by no one else,
    unless sticky (`shared_ok`; else ours and private). UsageError `bad <what> <path>: why`, one
    line, ending in `advice` (default: pick a directory of your own). `room_below`: bytes of path
    the caller's files need below it (a run's, under a log dir); 0 where it only writes files
    through the held directory (a dump in a run directory, a scheduler's error file), whose
    paths no process opens whole."""
    if "\0" in path:  # (only the Python API can pass one) said here: Python 3.13 words the OS call's refusal anew
        raise UsageError(f"bad {what} {quoted(path)}: embedded null byte")
    path = os.path.abspath(path)
    if room_below:
        _check_room_below(path, what, room_below)
    try:
        fd = _walk(path, make)
    except _Refused as exc:
        raise UsageError(f"bad {what} {path}: {exc}; {advice or 'pick a directory of your own'}") from None
    except NotADirectoryError as exc:
        where = "it" if exc.filename in (None, path) else exc.filename
        raise LogDirNotADirectory(f"bad {what} {path}: {where} is not a directory") from None
    except OSError as exc:
        if isinstance(exc, FileNotFoundError) and not make:
            raise UsageError(f"bad {what} {path}: it does not exist") from None
        raise UsageError(f"bad {what} {path}: cannot {'write' if make else 'open'} there ({exc.strerror})") from None
    problem = _root_problem(os.fstat(fd), allow_sticky=shared_ok)
    if problem:
        os.close(fd)
        raise UsageError(f"bad {what} {path}: it {problem}, so others could tamper with run logs: "
                         f"{advice or 'chmod go-w it, or pick a directory of your own'}")
    return Dir(path, fd)


def _check_room_below(path: str, what: str, room: int) -> None:
    """A chosen directory must leave room below it for the run's paths: one past PATH_MAX is a
    path no process can open (the ranks' TORCHELASTIC_ERROR_FILE, `ranktop logs RUN_DIR`)."""
    size, most = len(os.fsencode(path)), PATH_MAX - 1 - room
    if size > most:
        raise UsageError(f"bad {what} {path[:80]}...: its path is {size} bytes long, and at most {most} leave "
                         f"room for a run's files below it within the {PATH_MAX - 1} bytes of a path; "
                         "pick a shorter one")


class _Refused(Exception):
    """A directory or symlink on the way to a chosen directory that someone else controls; says which."""


_MAX_LINKS = 40  # the kernel's limit on symlinks followed in one lookup
# O_PATH: a directory on the way needs only search permission, as in the kernel's own lookup (a
# 0711 /home or /scratch); only the chosen directory itself is opened for reading.
_LOOKUP_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def path_problem(path: str) -> str | None:
    """Why the directory at the absolute `path` cannot be trusted by path (`_walk`: someone else
    controls a directory or a link on the way), None if it can (or cannot be reached at all: its
    use says why). For the socket directory, which a Unix socket reaches by path only."""
    try:
        os.close(_walk_into(path))
    except _Refused as exc:
        return str(exc)
    except OSError:
        return None
    return None


def _walk_into(path: str) -> int:
    """An O_PATH descriptor of the directory at `path`, walked to (`_walk`), to make and open
    names in by path later: held to the rule of every directory looked into on the way."""
    fd = _walk(path, make=False, read=False)
    try:
        _check_looked_into(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk(path: str, make: bool, read: bool = True) -> int:
    """A held descriptor of the absolute `path`, reached one name at a time from `/`, each
    directory held while the next name is looked up in it; missing ones made (0700) there with
    `make`, else FileNotFoundError. Without `read`, an O_PATH one (to make and open names in:
    a directory others may write and search but not list, as some /tmp are).

    Whoever may rename entries of a directory on the way decides where the rest of the path
    leads, at any moment (a check of the path followed by its use loses that race), so each
    directory looked into is held to the --log-dir's own rule: ours or root's, and writable by no
    one else unless sticky (/tmp). In such a shared directory, a symlink is followed only when it
    is ours or root's (the kernel's protected_symlinks rule, whatever the sysctl says)."""
    names, links = path.split("/")[::-1], 0
    fd, at = os.open("/", _LOOKUP_FLAGS), "/"
    try:
        while names:
            name = names.pop()
            if name in ("", "."):
                continue
            _check_looked_into(fd, at)
            here = os.path.join(at, name)
            info = _lstat_or_make(name, fd, make)
            if stat.S_ISLNK(info.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                _check_link(info, fd, here)
                target = os.readlink(name, dir_fd=fd)
                names.extend(target.split("/")[::-1])
                if target.startswith("/"):
                    fd, at = _swap(fd, os.open("/", _LOOKUP_FLAGS)), "/"
                continue
            if not stat.S_ISDIR(info.st_mode):
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), here)
            fd = _swap(fd, os.open(name, _LOOKUP_FLAGS | os.O_NOFOLLOW, dir_fd=fd))
            at = os.path.dirname(at) if name == ".." else here
        return _swap(fd, os.open(".", _DIR_FLAGS, dir_fd=fd)) if read else fd
    except BaseException:
        os.close(fd)
        raise


def _swap(old: int, new: int) -> int:
    os.close(old)
    return new


def _lstat_or_make(name: str, dir_fd: int, make: bool) -> os.stat_result:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        if not make:
            raise
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)  # each one private: no one else lists the run ids in it
        except FileExistsError:
            pass
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def _check_looked_into(fd: int, path: str) -> None:
    problem = _root_problem(os.fstat(fd), allow_sticky=True)
    if problem:
        raise _Refused(f"it goes through {path}, which {problem}: whoever controls it decides where "
                       "the path leads")


def _check_link(info: os.stat_result, dir_fd: int, path: str) -> None:
    # Group-writable counts as shared too: a sticky team directory lets every member plant links,
    # as /tmp lets everyone, and a member's directory there is refused already (_check_looked_into).
    shared = os.fstat(dir_fd).st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if shared and info.st_uid not in (os.geteuid(), 0):
        raise _Refused(f"it goes through {path}, a symlink of uid {info.st_uid}'s in a directory others "
                       "may write: ranktop will not follow it")


def _root_problem(info: os.stat_result, allow_sticky: bool) -> str | None:
    me = os.geteuid()
    if info.st_uid != me and (not allow_sticky or info.st_uid != 0):
        return f"belongs to uid {info.st_uid}, not to you (uid {me})"
    shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if shared and not (allow_sticky and info.st_mode & stat.S_ISVTX):
        who = {stat.S_IWGRP: "group", stat.S_IWOTH: "others"}.get(shared, "group and others")
        return f"is writable by {who} (mode {stat.S_IMODE(info.st_mode):o})"
    return None
