"""torch 2.13's `LogsSpecs` API (`start_processes(..., logs_specs=DefaultLogsSpecs(...))`), in
ranktop's terms: where a group's files go, decided from the ranks' environment.

`DefaultLogsSpecs.reify` makes `<log_dir>/<run id>_<random>/attempt_<restart count>/` as torch
does, but private (0700, made fresh, never emptied or reused: a spec that serves a second call
with the same restart count gets a fresh run directory), and reached as a --log-dir is: log_dir
walked from `/` at each call, each directory on the way held to the --log-dir's rule, and what
lies below made relative to it (`layout.open_chosen_dir`). The context then holds the attempt's
directory and opens every file of the group inside it (core/layout.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field

from ranktop.core.errors import UsageError
from ranktop.core.layout import (
    DIR_MODE,
    ERROR_FILE,
    STDERR_LOG,
    STDOUT_LOG,
    Dir,
    LogDirNotADirectory,
    open_chosen_dir,
    open_dir_below,
)
from ranktop.core.sanitize import quoted
from ranktop.core.spec import Std, per_rank


@dataclass
class LogsDest:
    """For each kind of log, local rank -> the file's path (torch's field names)."""

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = ""
    filtered_stderr: str = ""


class LogsSpecs(ABC):
    """Where a group's logs go, and which streams are redirected (files only) or teed."""

    def __init__(self, log_dir: str | None = None, redirects: Std | Mapping[int, Std] = Std.NONE,
                 tee: Std | Mapping[int, Std] = Std.NONE, local_ranks_filter: set[int] | None = None) -> None:
        self._root_log_dir = log_dir
        self.redirects = redirects
        self.tee = tee
        self.local_ranks_filter = local_ranks_filter

    @abstractmethod
    def reify(self, envs: Mapping[int, MutableMapping[str, str]]) -> LogsDest:
        """The files of each local rank, given the ranks' environment; makes their directory and
        sets each rank's TORCHELASTIC_ERROR_FILE in `envs`."""

    @property
    @abstractmethod
    def root_log_dir(self) -> str: ...

    @property
    def attempt_dir(self) -> str:
        """The directory the last reify() made: the group's files go there."""
        raise NotImplementedError


class DefaultLogsSpecs(LogsSpecs):
    """torch's default layout: `<log_dir>/<TORCHELASTIC_RUN_ID>_<random>/attempt_<N>/<rank>/`."""

    def __init__(self, log_dir: str | None = None, redirects: Std | Mapping[int, Std] = Std.NONE,
                 tee: Std | Mapping[int, Std] = Std.NONE, local_ranks_filter: set[int] | None = None) -> None:
        if log_dir == os.devnull:
            # torch's "no files at all"; ranktop's context writes each rank's error file and
            # logs into a directory it holds, so there is nothing to run that mode on.
            raise LogDirNotADirectory(f"log_dir: {os.devnull} (no log files) is not supported by ranktop; "
                                      "give a directory, or none for a fresh temporary one")
        if not log_dir:
            log_dir = tempfile.mkdtemp(prefix="torchelastic_")
        # Made (0700 all the way) and checked now, so that a bad one is refused at once; walked
        # to again at each call, as whoever controls it could have changed it since.
        open_chosen_dir(log_dir, "log_dir", make=True).close()
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_log_dir: str | None = None
        self._attempt_dir: str | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    @property
    def attempt_dir(self) -> str:
        if self._attempt_dir is None:
            raise RuntimeError("reify() has not made the attempt's directory yet")
        return self._attempt_dir

    def _make_attempt_dir(self, first: Mapping[str, str]) -> str:
        """<run dir>/attempt_<restart count>, made fresh (0700). The run dir is made at the first
        call; where this restart count's directory is there already (the spec serves another
        call), a fresh run dir takes it. torch empties and reuses that directory instead: here the
        earlier call's files are kept, and nothing a rank left there is written into."""
        name = f"attempt_{_restart_count(first)}"
        root = open_chosen_dir(str(self._root_log_dir), "log_dir", make=True)
        try:
            if self._run_log_dir is not None and _made_below(root, os.path.basename(self._run_log_dir), name):
                return os.path.join(self._run_log_dir, name)
            prefix = f"{first.get('TORCHELASTIC_RUN_ID', 'test_run_id')}_".replace("/", "_")
            try:
                self._run_log_dir = root.path_of(root.fresh(prefix))
            except OSError as exc:  # a run id too long for a file name, a full disk
                raise UsageError(f"bad log_dir {root.path}: cannot make a run directory there for run id "
                                 f"{quoted(prefix[:-1][:60])} ({exc.strerror})") from None
            _made_below(root, os.path.basename(self._run_log_dir), name)
            return os.path.join(self._run_log_dir, name)
        finally:
            root.close()

    def reify(self, envs: Mapping[int, MutableMapping[str, str]]) -> LogsDest:
        first = envs.get(0, {}) if envs else {}
        attempt = self._attempt_dir = self._make_attempt_dir(first)
        nprocs = len(envs)
        redirects, tee = per_rank(self.redirects, nprocs), per_rank(self.tee, nprocs)
        # torch treats an empty filter like none at all (it tests the set's truth): so do we.
        hidden = set(range(nprocs)) - set(self.local_ranks_filter) if self.local_ranks_filter else set()
        dest = LogsDest(filtered_stdout=os.path.join(attempt, "filtered_stdout.log"),
                        filtered_stderr=os.path.join(attempt, "filtered_stderr.log"))
        for r in range(nprocs):
            rank_dir = os.path.join(attempt, str(r))
            for paths, tees, flag, name in ((dest.stdouts, dest.tee_stdouts, Std.OUT, STDOUT_LOG),
                                            (dest.stderrs, dest.tee_stderrs, Std.ERR, STDERR_LOG)):
                # torch: a teed stream is redirected too (the console copy tails the file); "" is
                # the console as is, and os.devnull a console stream of a rank the filter leaves out.
                if (redirects[r] | tee[r]) & flag:
                    paths[r] = os.path.join(rank_dir, name)
                else:
                    paths[r] = os.devnull if r in hidden else ""
                if tee[r] & flag and r not in hidden:
                    tees[r] = paths[r]
            dest.error_files[r] = os.path.join(rank_dir, ERROR_FILE)
            # In place, as torch does: the caller's envs are what the ranks get.
            envs[r]["TORCHELASTIC_ERROR_FILE"] = dest.error_files[r]
        return dest


def _restart_count(env: Mapping[str, str]) -> int:
    """Rank 0's TORCHELASTIC_RESTART_COUNT, which names the attempt's directory: UsageError (a
    ValueError, one line naming it) for what is not a whole number (int()'s error named neither)."""
    count = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        return int(count)
    except (TypeError, ValueError):
        raise UsageError(f"envs[0]['TORCHELASTIC_RESTART_COUNT'] {quoted(str(count)[:40])}: expected the "
                         "restart count, a whole number") from None


def _made_below(root: Dir, run: str, name: str) -> bool:
    """Whether `name` was made (0700) in `root`'s directory `run` (not followed if a symlink);
    False where `run` is gone or `name` is there already."""
    try:
        fd = open_dir_below(root.fd, [run])
    except OSError:
        return False
    try:
        os.mkdir(name, DIR_MODE, dir_fd=fd)
        return True
    except FileExistsError:
        return False
    finally:
        os.close(fd)


__all__ = ["DefaultLogsSpecs", "LogDirNotADirectory", "LogsDest", "LogsSpecs", "to_map"]


def to_map(val_or_map: Std | Mapping[int, Std], local_world_size: int) -> dict[int, Std]:
    """torch's helper: one Std for every local rank, or the map as given (missing ranks: NONE)."""
    if isinstance(val_or_map, Std):
        return dict.fromkeys(range(local_world_size), val_or_map)
    return {r: val_or_map.get(r, Std.NONE) for r in range(local_world_size)}


_TORCH_API = "torch.distributed.elastic.multiprocessing.api"
# The attribute of torch's DefaultLogsSpecs that keeps the one of ours standing for it (torch's is
# unhashable: no mapping can hold it), so the restarts of one run share a `<run id>_<random>`
# directory, as they do with torch's.
_ADOPTED = "_ranktop_logs_specs"


def adopt_logs_specs(specs: object) -> object:
    """torch's own DefaultLogsSpecs, as ours with its log_dir, redirects, tee and filter, so code
    that still imports torch's keeps working; anything else as given. A LogsSpecs of torch's with
    a reify of its own cannot be honoured (ranktop lays out and holds the files itself): TypeError."""
    torch_api = sys.modules.get(_TORCH_API)  # loaded if the caller made one of torch's
    if torch_api is None or not isinstance(specs, torch_api.LogsSpecs):
        return specs
    if type(specs).reify is not torch_api.DefaultLogsSpecs.reify:
        raise TypeError(f"logs_specs: torch's {type(specs).__name__} has a reify of its own, which ranktop "
                        "cannot honour (it lays out the files itself); use DefaultLogsSpecs")
    ours = getattr(specs, _ADOPTED, None)
    if ours is None:
        ours = DefaultLogsSpecs(specs.root_log_dir, _our_std(specs._redirects), _our_std(specs._tee),
                                specs._local_ranks_filter)
        setattr(specs, _ADOPTED, ours)
    return ours


def _our_std(value: object) -> Std | dict[int, Std]:
    """torch's Std (or a map of them by rank) as ranktop's: the same flag values."""
    if isinstance(value, Mapping):
        return {rank: Std(int(v)) for rank, v in value.items()}
    return Std(int(value))
