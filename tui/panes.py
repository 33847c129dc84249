"""What the main screen is made of: the job header, one pane per rank, the compact rank list.

Everything here is drawn from engine snapshots (core.state) handed in by the screen's timer; no
widget here polls the engine or touches a process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable

from ranktop.core.engine import FIRST_LOOK_LINES, Engine, OutputCursor
from ranktop.core.state import (
    GpuSample,
    GroupSnapshot,
    GroupState,
    RankSnapshot,
    RankState,
    world_undecided,
)
from ranktop.tui.cells import drawable
from ranktop.tui.commands import action_name
from ranktop.tui.logview import LogView
from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.events import Click
from textual.message import Message
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Static
from textual.widgets._footer import FooterKey

# Style per state: the one place the palette lives, shared by titles, the rank list and the help.
# Every state reads from its text first; the states that need a look (failed, stalled, paused,
# waiting for input, unreapable) are reversed, so they stand out under NO_COLOR too, where
# colours are dropped.
# Ranks ranktop stopped (killed) are not red: they are effects, not failures.
STATE_STYLE = {
    RankState.STARTING: "yellow",
    RankState.RUNNING: "bold green",
    RankState.STALLED: "bold reverse magenta",
    RankState.STOPPING: "yellow",
    RankState.SUCCEEDED: "bold blue",
    RankState.FAILED: "bold reverse red",
    RankState.KILLED: "italic yellow",
    RankState.UNREAPABLE: "bold reverse magenta",
    RankState.UNKNOWN: "reverse yellow",  # (as the end panel's END UNKNOWN: the engine was lost)
}
PAUSED_STYLE = "bold reverse yellow"
INPUT_STYLE = "bold reverse cyan"  # waiting at a prompt (pdb): `i` types into it

GROUP_STYLE = {
    GroupState.INIT: "yellow",
    GroupState.RENDEZVOUS: "yellow",
    GroupState.RUNNING: "bold green",
    GroupState.RESTARTING: "bold yellow",
    GroupState.STOPPING: "bold yellow",
    GroupState.SUCCEEDED: "bold blue",
    GroupState.FAILED: "bold reverse red",
    GroupState.STOPPED: "bold yellow",
}


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit in ("B", "K", "M") or n >= 100 else f"{n:.1f}{unit}"
        n /= 1024
    return "-"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def human_duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def waits(snap: RankSnapshot) -> bool:
    """Alive but waiting on someone: paused (SIGSTOP), or at an input prompt (pdb)."""
    return (snap.paused and snap.state.alive) or snap.input_prompt is not None


def end_held(snap: RankSnapshot) -> bool:
    """Whether the engine holds the rank's end by a signal as maybe part of a stop from outside."""
    return snap.end_held and snap.signal_name is not None  # (a signal's: what the label names)


def state_label(snap: RankSnapshot) -> str:
    """'running', 'exited 0', 'exit 1', 'failed SIGSEGV', 'killed SIGKILL', 'paused', 'input (i)';
    'ended SIGTERM' while the engine holds its end as maybe part of a stop from outside (it said
    `failed`, in red, for that second, and then often `killed`)."""
    if snap.paused and snap.state.alive:
        return "paused"
    if end_held(snap):
        return f"ended {snap.signal_name}"
    if snap.input_prompt:  # (a live rank's: before stalled, which the ranks waiting for it are too)
        return "input (i)"
    if snap.state == RankState.SUCCEEDED:
        return "exited 0"
    if snap.state == RankState.FAILED and snap.signal_name is None and snap.exitcode is not None:
        return f"exit {snap.exitcode}"
    if snap.state in (RankState.FAILED, RankState.KILLED):
        detail = snap.signal_name or (str(snap.exitcode) if snap.exitcode is not None else "")
        return f"{snap.state.value} {detail}".strip()
    if snap.state == RankState.STALLED and snap.stall_seconds is not None:
        return f"stalled {human_age(snap.stall_seconds)}"
    return snap.state.value


def look(style: str) -> str:
    """`style` as shown: under NO_COLOR its colours are dropped here, keeping bold/reverse/italic.
    Textual would turn them into greys, and a reversed dark grey on a dark title is unreadable;
    reversed default colours are not."""
    if os.environ.get("NO_COLOR") is None:
        return style
    return str(Style.parse(style).without_color) or "none"


def state_style(snap: RankSnapshot) -> str:
    if snap.paused and snap.state.alive:
        return look(PAUSED_STYLE)
    if end_held(snap):  # neither a failure yet nor a stop: as a stopping rank
        return look(STATE_STYLE[RankState.STOPPING])
    return look(INPUT_STYLE if snap.input_prompt else STATE_STYLE[snap.state])


def last_output_age(snap: RankSnapshot, now: float) -> float | None:
    """Whole seconds since the rank last printed, counted as the clock's seconds turn, so that
    every rank's age turns at once; None once it is gone (a dead rank's "0s ago" would read as if
    it were still talking). Counted from each rank's own moment, the ages of 64 quiet ranks turned
    at 64 moments a second, and the rank list was drawn anew at every tick (6-10% of a core)."""
    if snap.last_output_at is None or not snap.state.alive:
        return None
    return float(math.floor(now) - math.floor(snap.last_output_at))


def pid_text(snap: RankSnapshot, *, narrow: bool = False) -> str:
    """' pid 1234' (narrow: ' 1234'); of a rank whose state the view lost with the engine, marked
    as the pid it had when last seen: ' last seen: pid 1234' (narrow: ' seen 1234')."""
    pid = f" {snap.pid}" if snap.pid else " -"
    if snap.state == RankState.UNKNOWN:
        return (" seen" if narrow else " last seen: pid") + pid
    return ("" if narrow else " pid") + pid


def gpu_util_text(gpu: GpuSample) -> str:
    return "-" if gpu.util_percent is None else f"{gpu.util_percent:.0f}%"


def gpu_text(snap: RankSnapshot) -> str | None:
    gpu = snap.gpu
    if gpu is None or gpu.index is None:
        return None
    util = gpu_util_text(gpu)
    mem = human_bytes(gpu.proc_mem if gpu.proc_mem is not None else gpu.mem_used)
    total = human_bytes(gpu.mem_total)
    return f"gpu{gpu.index} {util} {mem}/{total}"


LOG_KEPT = 26  # cells of the zoomed title's log path that its sparklines leave: "…/attempt_0/0/stdout.log"
SPARKS_LEAST = 12  # cells a zoomed title keeps for its sparklines ("  loss ▅█▁▂▄"), before the labels


def rank_title(snap: RankSnapshot, now: float, *, world_digits: int = 1,
               narrow: bool = False, position: str | None = None, hits: int | None = None,
               metric: str | None = None, outlier: bool = False, sparks: Callable[[int | None], str] | None = None,
               log_path: str | None = None, width: int | None = None) -> Text:
    """One line: rank/local, pid, state, restarts, cpu, rss, GPU, last output age, and where the
    pane is (`position`: 'following' / 'paused at line N'). `narrow` (a pane under ~70 columns)
    drops the labels so the GPU and the age still fit. Zoomed, `sparks` gives the sparklines in
    the cells it may take (None: any) and `log_path` ends the line; with `width` known, the
    sparklines leave the path its last LOG_KEPT cells, the path gives up its start, and where
    even its file's name would not fit the labels go, so that name stays in view."""
    facts = (snap, now, world_digits, position, hits, metric, outlier)
    if sparks is None and not log_path:  # not zoomed: the labelled form, unless it would be cut
        title = _rank_facts(*facts, narrow=narrow)
        if not narrow and width and title.cell_len > width:
            # (a pane just over NARROW_TITLE: the labels cost its GPU memory and its last output's age)
            title = _rank_facts(*facts, narrow=True)
        return title
    shown = drawable(_short_path(log_path)) if log_path else ""
    least = f"  log {fit_path(shown, 0)}" if shown else ""  # its file's name, at the least
    need = cell_len(least) + (SPARKS_LEAST if sparks is not None else 0)
    for form in ({"narrow": narrow}, {"narrow": True}, {"narrow": True, "tight": True}):
        title = _rank_facts(*facts, **form)
        if not width or title.cell_len + need <= width:
            break
    if sparks is not None:
        kept = f"  log {fit_path(shown, LOG_KEPT)}" if shown else ""
        lines = sparks(width - title.cell_len - cell_len(kept) - 2 if width else None)
        if lines:
            title.append(f"  {lines}", style="cyan")
    if log_path:  # zoomed: where the whole output is (o opens it)
        _append_path(title, "  log ", log_path, width)
    return title


def _rank_facts(snap: RankSnapshot, now: float, world_digits: int, position: str | None, hits: int | None,
                metric: str | None, outlier: bool, *, narrow: bool, tight: bool = False) -> Text:
    """rank_title's line before the zoomed parts: the rank, its state and facts, where its pane is.
    `tight` (a zoomed title at 80 columns) also leaves out the memory: rss, the GPU's."""
    title = Text(no_wrap=True, overflow="ellipsis")
    title.append(f" {snap.rank:>{world_digits}}", style="bold")
    title.append(f"/{snap.local_rank} ", style="dim")
    title.append(f" {state_label(snap)} ", style=state_style(snap))
    if position and position != "following":  # early, so a narrow pane shows why new lines do not
        title.append(f" {position.replace('paused at line', 'paused @') if narrow else position} ",
                     style="bold reverse")
    if hits is not None:  # a search of every rank stands: how many of its lines match, early
        title.append(f" {hits} hit{'s' if hits != 1 else ''} ", style="bold reverse" if hits else "dim")
    if metric is not None:  # early: comparing ranks by it is the point of asking for it
        title.append(f" {metric}{' !' if outlier else ''} ", style="bold reverse" if outlier else "bold cyan")
    if snap.log_error:  # first, so a narrow pane still shows it: this rank's log misses output
        title.append(f" log: {snap.log_error}, {human_bytes(snap.log_bytes_lost)} lost ", style="bold white on red")
    title.append(pid_text(snap, narrow=narrow))
    if snap.restarts:
        title.append(f" ⟳{snap.restarts}", style="bold yellow")
    if snap.cpu_percent is not None:
        title.append(f" {snap.cpu_percent:.0f}%" if narrow else f"  cpu {snap.cpu_percent:.0f}%")
    if snap.rss is not None and not tight:
        title.append(f" {human_bytes(snap.rss)}")
    gpu = gpu_text(snap)
    if gpu and tight:
        gpu = " ".join(gpu.split()[:2])  # "gpu0 35%"
    if gpu:
        title.append(f" {gpu.replace('gpu', 'g', 1)}" if narrow else f"  {gpu}", style="cyan")
    age = last_output_age(snap, now)
    if age is not None:
        title.append(f" {human_age(age)}" if narrow else f"  {human_age(age)} ago",
                     style="dim" if age < 5 else "bold yellow")
    if position == "following" and not narrow:
        title.append("  following", style="dim")
    return title


# The header's parts that give way on a narrow terminal, least useful first: each goes whole, so
# that none is cut mid-word ("no" of "no GPU" at 80 columns), and none for a less useful one; one
# with shorter words (_short_parts: `(2 left)`, `NVML error`) says them before it goes.
# What is urgent (the state, a stop's countdown, a note, lost logs, a failed earlier attempt, a
# lost engine or store) never goes.
# A forming round's part goes last, after the badge: while a round forms, how far it got is the
# news (the ranks alive and the time are the last round's).
# An earlier attempt that ended in no failure (the user's R) is news, not a warning: it goes before
# the attempt and the clock (at 80 columns it took their room, and the live ranks' count's). One
# that failed (or was ended by another node: a peer's stop, a lost node) stays, but its words give
# up their end (_earlier_text): their first EARLIER_KEPT cells ("failed": only the forming round
# comes before them, and the badge goes for them, so `rank 1 failed (exit 4)` stays at 80
# columns), the rest where a calm one's place is ("earlier", after `(0 left)`), at the least
# `attempt_0: …`. A peer's stop is 120 cells of words: at 160 columns they pushed out the badge,
# the attempt, the clock and the forming round.
# The GPU status says why the panes show no GPU (a laptop, a CPU box; without it that reads as a
# sampler gone wrong): it stays longer than the ranks' python, the world, the node, the log dir and
# the restarts left (at 80 columns it went first, and `(2 restarts left)` took its room).
HEADER_DROPS = ("python", "last", "node", "world", "logs", "earlier", "restarts", "gpu", "attempt", "elapsed",
                "alive", "badge", "failed", "forming")
EARLIER_KEPT = 24
_LOGS_LABEL = "  logs "
BADGE = " ranktop "
# The job's name gives up its middle where the line is short of room, for the urgent parts: it
# keeps NAME_KEPT cells before a part goes, and NAME_LEAST at the least, the badge going first.
NAME_KEPT = 24
NAME_LEAST = 8

Part = tuple[str | None, Text]  # (its name in HEADER_DROPS; None: kept whatever the width), its text


def header_text(group: GroupSnapshot, now: float, *, note: str | None = None, width: int | None = None) -> Text:
    """The job line, most important first: name, state, the seconds left before a stop's SIGKILL,
    a note ("stopping…"), lost logs, the attempt and how earlier ones ended, world, node, elapsed,
    alive ranks, GPU status, the log dir. With `width` known, the parts that do not fit go whole
    (HEADER_DROPS), those with shorter words first saying them (`(2 left)`), the log dir gives up
    its start to fit the room left, and a long name its middle (fit_name), so that the urgent
    parts stay in sight."""
    parts = _header_parts(group, now, note)
    name, badge, logs = drawable(group.name), True, bool(group.log_dir)
    if width:  # (0: not laid out yet)
        width -= _ticking_room(group, now)
        failed = group.earlier_attempts and not group.earlier_calm  # (its least stays, whatever the width)
        squeeze = (lambda extra: _earlier_text(group, extra)) if failed else None
        room = width - sum(part.cell_len for key, part in parts if key is None) - 2  # (" name ")
        room -= squeeze(0).cell_len if squeeze else 0
        kept, least = min(cell_len(name), NAME_KEPT), min(cell_len(name), NAME_LEAST)
        parts, shown, left = _fitted(parts, _short_parts(group), drawable(_short_path(group.log_dir)) if logs else None,
                                     squeeze, room - kept, kept - least)
        badge, logs = "badge" in shown, "logs" in shown
        name = fit_name(name, max(least, kept + left))  # (narrower still, the line's ellipsis cuts its end)
    text = Text(no_wrap=True, overflow="ellipsis")  # (what is kept whatever the width, on a tiny terminal)
    if badge:
        text.append(BADGE, style="bold reverse")
    text.append(f" {name} ", style="bold")
    for _, part in parts:
        text.append_text(part)
    if logs:
        _append_path(text, _LOGS_LABEL, group.log_dir, width)
    return text


def fit_name(name: str, room: int) -> str:
    """`name` in `room` cells, its middle given up for "…": its start says which script or binary
    it is (train_, eval_), its end which of its kind (_v2_bf16.py); a long name piles its details
    in between."""
    if cell_len(name) <= room:
        return name
    room = max(0, room - 1)
    head = _cells_from_start(name, room - room // 2)
    tail = _cells_from_start(name[len(head):][::-1], room // 2)[::-1]
    return f"{head}…{tail}"


def _cells_from_start(text: str, cells: int) -> str:
    """The longest start of `text` in at most `cells` cells."""
    used = 0
    for i, char in enumerate(text):
        used += cell_len(char)
        if used > cells:
            return text[:i]
    return text


def _ticking_room(group: GroupSnapshot, now: float) -> int:
    """The cells a stop's countdown and the alive count fall short of their widest (`SIGKILL in
    10-10s` of a 10 s grace, as where the ranks' deadlines come to differ; all ranks alive): kept
    free, so that no part comes into the line, or goes, as they tick down or the countdown turns
    into a range, under the eyes of whoever watches them."""
    due = _due_for_kill(group)
    countdown = 0
    if due:
        widest = str(math.ceil(group.shutdown_timeout))
        countdown = cell_len(_countdown_words(group, due, f"{widest}-{widest}s")) - cell_len(kill_countdown(group, now))
    return max(0, countdown) + len(str(len(group.ranks))) - len(str(alive_count(group)))


def _fitted(parts: list[Part], shorts: dict[str, Text], logs: str | None, squeeze: Callable[[int], Text] | None,
            room: int, spare: int) -> tuple[list[Part], set[str], int]:
    """`parts` with those of HEADER_DROPS that fit the `room` the others leave, most useful first,
    so that no part goes for a less useful one: each whole where it fits, else in its words in
    `shorts` (the log dir counted as its last name, `…/NAME`, the least it shows); a failed
    earlier attempt, whose least `squeeze(0)` the room is without, in `squeeze(cells)`, the cells
    left, where it does not fit whole; the badge where the room and the name's `spare` cells (its
    kept ones past its least) hold it, the name's going first; the names of those kept (the
    badge's and the log dir's among them); and the room left (less than none: short of)."""
    shown: dict[str, Text | None] = {}  # the parts kept: None, whole; else in their shorter words
    extra = 0  # the cells of a failed earlier attempt's words shown past its least
    for name in reversed(HEADER_DROPS):
        if name == "restarts" and "attempt" not in shown:  # (said of the attempt)
            continue
        if name in ("failed", "earlier") and squeeze is not None:  # (it stays: only its words past its least go)
            more = _cells(parts, "earlier") - squeeze(0).cell_len - extra
            taken = min(more, max(0, room), EARLIER_KEPT if name == "failed" else more)
            extra, room = extra + taken, room - taken
            shown["earlier"] = None if taken == more else squeeze(extra)
            continue
        if name == "badge":  # (the urgent parts leave the name less than it keeps: the badge goes for it)
            if cell_len(BADGE) <= room + spare:
                shown[name], room = None, room - cell_len(BADGE)
            continue
        if name == "logs":
            forms = [(None, cell_len(_LOGS_LABEL + fit_path(logs, 0)) if logs is not None else 0)]
        else:
            forms = [(None, _cells(parts, name)), *([(shorts[name], shorts[name].cell_len)] if name in shorts else [])]
            if name == "restarts" and squeeze is not None:  # (`(0 left)` before a failed earlier attempt's words go)
                whole = _cells(parts, "earlier") - squeeze(0).cell_len - extra
                forms = [(form, need) for form, need in forms if form is not None or need + whole <= room] or forms
        for form, need in forms:
            if 0 < need <= room:
                shown[name] = form
                room -= need
                break
    kept = [(key, part if key is None or shown[key] is None else shown[key]) for key, part in parts
            if key is None or key in shown]
    return kept, set(shown), room


def _cells(parts: list[Part], name: str) -> int:
    return sum(part.cell_len for key, part in parts if key == name)


def _short_parts(group: GroupSnapshot) -> dict[str, Text]:
    """The parts with shorter words, for a narrow line: `(2 left)` for `(2 restarts left)`, and a
    GPU status without its reason (`NVML error: ...`, `GPU 1: ...`: up to 200 characters each;
    the details, m, say it whole)."""
    shorts = {}
    if group.max_restarts:
        shorts["restarts"] = Text(f" ({_restarts_left(group)} left)", style="dim")
    if group.gpu_status and ":" in group.gpu_status:
        what = "NVML error" if group.gpu_status.startswith("NVML error:") else "GPU error"
        shorts["gpu"] = Text(f"  {what}", style="dim")
    return shorts


def _header_parts(group: GroupSnapshot, now: float, note: str | None) -> list[Part]:
    end = group.ended_at if group.ended_at is not None else now
    parts: list[Part] = [(None, _state_text(group, now, note)), *_attempt_parts(group)]
    if group.interpreter:
        parts.append(("python", Text(f"  python {drawable(_short_path(group.interpreter))}", style="dim")))
    parts += [*_world_parts(group), ("elapsed", Text(f"  {human_duration(end - group.started_at)}")), _alive_part(group)]
    if group.gpu_status:
        parts.append(("gpu", Text(f"  {drawable(group.gpu_status)}", style="dim")))
    return parts


def _state_text(group: GroupSnapshot, now: float, note: str | None) -> Text:
    """The group's state, then what is urgent about it: a stop's countdown, the note, lost logs."""
    text = Text()
    if group.end_unknown:  # the engine was lost: the state last seen is no longer known
        text.append(" unknown ", style=look(STATE_STYLE[RankState.UNKNOWN]))
    else:
        text.append(f" {group.state.value} ", style=look(GROUP_STYLE[group.state]))
    countdown = kill_countdown(group, now)
    if countdown:  # before the note: how long the ranks have left is what a stop is waiting on
        text.append(f"  {countdown}", style="bold yellow")
    if note:
        text.append(f"  {note}", style="bold yellow")
    if group.incomplete_logs:
        lost = sum(loss.bytes_lost for loss in group.incomplete_logs)
        text.append(f" {len(group.incomplete_logs)} log(s) incomplete: {group.incomplete_logs[0].error}, "
                    f"{human_bytes(lost)} not saved ", style="bold white on red")
    return text


def _attempt_parts(group: GroupSnapshot) -> list[Part]:
    """The attempt, the restarts left and how the last earlier attempt ended."""
    # Named as its directory is (attempt_<k>); restarts the user asked for spend none of the limit.
    parts: list[Part] = [("attempt", Text(f"  attempt_{group.attempt}"))]
    if group.max_restarts:  # (given up before the attempt it is said of)
        left = _restarts_left(group)
        parts.append(("restarts", Text(f" ({left} restart{'s' * (left != 1)} left)", style="dim")))
    if group.earlier_attempts:  # "all ranks exited 0" must not hide that an earlier attempt failed
        parts.append(("earlier", _earlier_text(group)))  # (a failed one stays: header_text's squeeze)
    return parts


def _earlier_text(group: GroupSnapshot, extra: int | None = None) -> Text:
    """How the last earlier attempt ended (`(+N)`: those before it), whole, or with `extra` cells
    of its words past `attempt_0: …`, the least a failed one shows: its words give up their end,
    so that what failed, `rank 1 failed (exit 4)`, is what stays."""
    more = group.earlier_count - 1
    words = drawable(group.earlier_attempts[-1])
    if extra is not None:
        attempt, sep, _ = words.partition(": ")
        head = attempt + sep if sep and cell_len(attempt) <= 20 else ""  # (`attempt_<k>: `, kept)
        how = words[len(head):]
        words = head + (how if cell_len(how) <= 1 + extra else _cells_from_start(how, extra) + "…")
    return Text(f"  earlier: {words}" + (f" (+{more})" if more else ""),
                style="yellow" if group.earlier_calm else "bold yellow")


def _restarts_left(group: GroupSnapshot) -> int:
    return max(0, group.max_restarts - (group.attempt - group.user_restarts))


def _world_parts(group: GroupSnapshot) -> list[Part]:
    """World size, this node and the rendezvous round, and a lost store."""
    parts: list[Part]
    if group.forming is not None:
        parts = _forming_parts(group)
    elif world_undecided(group.state, group.round, bool(group.ranks)):  # the first round decides both: the command line's are guesses
        parts = [("world", Text("  world ?")), ("node", Text("  node ?"))]
    else:
        parts = [("world", Text(f"  world {group.world_size}")),
                 ("node", Text(f"  node {group.node_rank}/{group.nnodes}"
                               + (f" round {group.round}" if group.round is not None else "")))]
    if group.store_lost:  # the rendezvous's store, gone (no new round can form) or silent: the ranks run on
        parts.append((None, Text("  store silent" if group.store_silent else "  store lost", style="bold yellow")))
    return parts


def _forming_parts(group: GroupSnapshot) -> list[Part]:
    """The round this node joins and what is known of it (`round 3 forming: 1 of 2 nodes`, `not
    formed` once the run ended without it), and the last round's world, node and round, marked as
    the last: they held while its ranks ran, and the new round may decide others."""
    forming = group.forming
    what = "round" if forming.number is None else f"round {forming.number}"
    how = "forming" if not group.state.finished else "not formed"
    if forming.joined is not None:  # (live only: a round that timed out has had its nodes step out)
        how += f": {forming.joined} of {drawable(forming.nodes)} nodes" if forming.nodes else f": {forming.joined} joined"
    parts: list[Part] = [("forming", Text(f"  {what} {how}", style="yellow"))]
    if group.round is not None:
        parts.append(("last", Text(f"  last round {group.round}: world {group.world_size} "
                                   f"node {group.node_rank}/{group.nnodes}", style="dim")))
    return parts


def _alive_part(group: GroupSnapshot) -> Part:
    if group.end_unknown:  # (the ranks alive when the engine was lost are of unknown state now)
        seen = sum(1 for r in group.ranks if r.state == RankState.UNKNOWN)
        return None, Text(f"  engine lost: {seen}/{len(group.ranks)} alive when last seen", style="bold yellow")
    return "alive", Text(f"  {alive_count(group)}/{len(group.ranks)} alive", style="dim")


def kill_countdown(group: GroupSnapshot, now: float) -> str | None:
    """`SIGKILL in 17s` while a stop's grace runs (`rank 3 SIGKILL in 8s` where only some are
    being stopped, e.g. one restarted); `SIGKILL in 8-17s` where the ranks' deadlines differ (a
    rank restarted before the group's stop: the soonest alone read as the whole group's); None
    when no stop is under way."""
    due = _due_for_kill(group)
    if not due:
        return None
    soonest, latest = _seconds_to_kill(due, now), _seconds_left(max(r.kill_at for r in due), now)
    return _countdown_words(group, due, f"{soonest}s" if soonest == latest else f"{soonest}-{latest}s")


def _countdown_words(group: GroupSnapshot, due: list[RankSnapshot], left: str) -> str:
    """kill_countdown's words for the seconds `left` ("8s", "8-17s")."""
    if len(due) == alive_count(group):
        return f"SIGKILL in {left}"
    names = ",".join(str(r.rank) for r in due[:3]) + ("…" if len(due) > 3 else "")
    return f"rank{'s' if len(due) > 1 else ''} {names} SIGKILL in {left}"


def alive_count(group: GroupSnapshot) -> int:
    """How many of the group's ranks are alive."""
    return sum(1 for r in group.ranks if r.state.alive)


def _due_for_kill(group: GroupSnapshot) -> list[RankSnapshot]:
    """The live ranks a stop's SIGKILL is due for (kill_countdown and the room kept for it)."""
    return [r for r in group.ranks if r.state.alive and r.kill_at is not None]


def _seconds_to_kill(due: list[RankSnapshot], now: float) -> int:
    """Whole seconds left before the soonest SIGKILL of `due` (not empty), 0 once it is past."""
    return _seconds_left(min(r.kill_at for r in due), now)


def _seconds_left(deadline: float, now: float) -> int:
    return math.ceil(max(0.0, deadline - now))


def _short_path(path: str) -> str:
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home != "/" and path.startswith(home + os.sep) else path


def _append_path(line: Text, label: str, path: str, width: int | None) -> None:
    """`label` and `path` at the end of `line`, dimmed. A path longer than the room left gives up
    its start ("…/attempt_0/1/stdout.log"), not its end as the line's own ellipsis would: the end
    says which run and file it is."""
    shown = drawable(_short_path(path))
    if width:  # (0: not laid out yet)
        shown = fit_path(shown, width - line.cell_len - cell_len(label))
    line.append(label + shown, style="dim")


def fit_path(path: str, room: int) -> str:
    """`path` in at most `room` cells, whole components dropped from its start for "…"; at least
    its last component, however long (the line's ellipsis cuts that)."""
    parts = path.rstrip("/").split("/")
    if cell_len(path) <= room or len(parts) < 2:  # (nothing before a last name to give up)
        return path
    kept = parts[-1]
    for part in reversed(parts[1:-1]):
        if cell_len(f"…/{part}/{kept}") > room:
            break
        kept = f"{part}/{kept}"
    return f"…/{kept}"


class RankFeed:
    """One rank's output pulled through the engine, in the shape a LogView polls: `version` (set by
    the screen from each snapshot, so an unchanged rank costs one compare), `since()` and `maxlen`.
    One feed per attempt: a new attempt's lines start from line 0 again.

    A new feed first asks for the newest FIRST_LOOK_LINES only and the whole scrollback on the next
    poll: a pane opened on a long run (`ranktop attach`, a zoom) shows its screen without waiting
    for 10k lines a rank to cross the socket and be measured."""

    _AGAIN = -3  # a version no ring has: the pane polls again on the next tick

    def __init__(self, engine: Engine, local_rank: int, generation: int, maxlen: int) -> None:
        self._engine = engine
        self.local_rank = local_rank
        self.generation = generation
        self.maxlen = maxlen
        self.version = -1
        self._asked = False
        self._scrollback_due = False  # the first answer was only the tail: fetch from the start next

    @property
    def scrollback_due(self) -> bool:
        """Whether the pane holds only the newest lines so far: its next poll takes the rest."""
        return self._scrollback_due

    def since(self, seen: int) -> tuple[int, int, list[bytes], list[bytes]]:
        first, self._asked = not self._asked, True
        if self._scrollback_due:
            seen, self._scrollback_due = 0, False  # the LogView takes the whole window in place of the tail
        tail = FIRST_LOOK_LINES if first else None
        cursor, lines, open_lines = self._engine.output_since(self.local_rank, OutputCursor(self.generation, seen), tail)
        if cursor.generation != self.generation:  # the next attempt began: the screen brings a new feed
            return self.version, seen, [], []
        if first and len(lines) == FIRST_LOOK_LINES:
            self._scrollback_due = True
            return self._AGAIN, cursor.line, lines, open_lines
        return cursor.version, cursor.line, lines, open_lines


class LiveText(Static):
    """Styled text redrawn every tick (the header, a pane's title, the rank list) that repaints
    only when its characters change, and asks for a layout pass only when its number of lines
    does: most ticks change nothing, and a layout pass re-arranges the whole screen."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(" ", id=id, classes=classes, markup=False)
        self._plain: str | None = None

    @property
    def plain(self) -> str:
        """The text shown, without its styles."""
        return self._plain or ""

    def show(self, text: Text) -> None:
        if text.plain != self._plain:
            lines_changed = text.plain.count("\n") != self.plain.count("\n")
            self._plain = text.plain
            self.update(text, layout=lines_changed)


PALETTE_KEY_CELLS = 12  # "▏^p palette ", docked at the footer's right end


def footer_fit(labels: list[tuple[str, str]], width: int) -> tuple[bool, int]:
    """(compact, how many) of these (key, description) labels the footer shows whole in `width`
    columns, in their order: the roomy style where it shows as many keys, else the compact one.
    The first keys are the most useful; the rest are in the help (?) and the palette, and work."""
    room = width - PALETTE_KEY_CELLS
    fits = [_keys_that_fit(labels, room, pad) for pad in (3, 2)]  # " k desc " | "k desc" and a margin
    return (fits[1] > fits[0]), max(fits)


def footer_keys(keys: list[tuple[str, str, bool]], width: int) -> tuple[bool, tuple[int, ...]]:
    """(compact, which) of these (key, description, dimmed) the footer shows, as footer_fit, but
    where not all fit, the dimmed keys (they can do nothing now) give way first: while a round
    forms, at 80 columns, the dimmed `x` and `k` took the room of `K`, the one that acts then."""
    labels = [(key, description) for key, description, _ in keys]
    compact, shown = footer_fit(labels, width)
    if shown == len(keys) or not any(dimmed for *_, dimmed in keys):
        return compact, tuple(range(shown))
    whole = [at for at, (*_, dimmed) in enumerate(keys) if not dimmed]
    compact, shown = footer_fit([labels[at] for at in whole], width)
    return compact, tuple(whole[:shown])


def _keys_that_fit(labels: list[tuple[str, str]], room: int, pad: int) -> int:
    used = 0
    for shown, (key, description) in enumerate(labels):
        used += cell_len(key) + cell_len(description) + pad
        if used > room:
            return shown
    return len(labels)


def read_only(app: object) -> bool:
    """Whether the app shows a run it may not act on (`ranktop web` without --control)."""
    return bool(getattr(getattr(app, "engine", None), "read_only", False))


# The actions that act on ranks (the grid's, and the stack view's SIGUSR1 fallback, `signal`
# too): a read-only view's footer leaves them out (they answer "read-only view: nothing was
# done"), and so does any view once the run has ended.
ACTS_ON_RANKS = ("signal", "kill_rank", "kill_group", "restart_rank", "restart_group", "type_input")


def can_act(app: object) -> bool:
    """Whether keys that act on ranks can do anything here: not in a read-only view, nor once
    the run has ended (its final view, local or attached: nothing is left to act on). The
    footer, the ? help and the palette offer those keys only while this holds."""
    main = getattr(app, "main", None)
    return not read_only(app) and not (main is not None and main.ended)


class CalmFooter(Footer):
    """Textual's Footer, rebuilt once per burst of binding changes rather than once per change,
    and only when the keys it shows did change. Opening the main screen moves the focus five
    times, and moving it from pane to pane changes nothing the footer shows, but each rebuild
    mounts and styles a dozen keys (~80 ms before the first frame of `ranktop attach`).
    It shows only the keys that fit whole (footer_keys): Textual's would cut the last one mid-word."""

    SETTLE_SECONDS = 0.05

    def __init__(self, *, hidden: Iterable[str] = ()) -> None:
        """`hidden`: actions (names without their arguments) the footer leaves out, such as the
        ones that act on ranks in a read-only view: their keys still answer, saying so."""
        super().__init__()
        self._hidden = frozenset(hidden)
        self._settling = False
        self._shown: tuple | None = None  # the keys of the last rebuild
        self._labels: list[tuple[str, str, bool]] = []  # every key the last rebuild had, shown or not
        self._fit: tuple[bool, tuple[int, ...]] | None = None  # the last rebuild's footer_keys

    def compose(self) -> ComposeResult:
        made = list(super().compose())
        hidden = {w for w in made if isinstance(w, FooterKey) and action_name(w.action) in self._hidden}
        keys = [w for w in made if isinstance(w, FooterKey) and not w.has_class("-command-palette") and w not in hidden]
        self._labels = [(key.key_display, key.description, key.has_class("-disabled")) for key in keys]
        self._fit = footer_keys(self._labels, self.app.size.width)
        self.compact, shown = self._fit
        left_out = {key for at, key in enumerate(keys) if at not in shown} | hidden
        yield from (w for w in made if w not in left_out)

    def hide(self, actions: Iterable[str]) -> None:
        """Leave these actions out too from now on (the run has ended: they can do nothing)."""
        if not frozenset(actions) <= self._hidden:
            self._hidden |= frozenset(actions)
            self.call_next(self.recompose)  # (in the footer's own context: its keys bind to it)

    def on_resize(self) -> None:
        if self._fit is not None and footer_keys(self._labels, self.app.size.width) != self._fit:
            self.call_after_refresh(self.recompose)

    def bindings_changed(self, screen: Screen) -> None:
        if not self._settling:
            self._settling = True
            self.set_timer(self.SETTLE_SECONDS, lambda: self._settled(screen))

    def _settled(self, screen: Screen) -> None:
        self._settling = False
        shown = tuple((binding.key, binding.action, binding.description, enabled, tooltip)
                      for _, binding, enabled, tooltip in screen.active_bindings.values() if binding.show)
        if shown != self._shown:
            if screen.app.app_focus and self.is_attached and screen is self.screen:
                self._shown = shown  # (Textual's rebuilds only then: otherwise the next change must)
            super().bindings_changed(screen)


class GroupHeader(LiveText):
    """The header line. `note` (e.g. "stopping…") and `ended` are the screen's, bound down to it
    (data_bind): a note shows until the group ends, and a new note repaints at once, between ticks.
    A `standing` note ("read-only view") shows in place of none, the end included."""

    note: reactive[str | None] = reactive(None, init=False)
    ended: reactive[bool] = reactive(False, init=False)

    def __init__(self, *, id: str | None = None, standing: str | None = None) -> None:
        super().__init__(id=id)
        self._group: tuple[GroupSnapshot, float] | None = None
        self._standing = standing

    def show_group(self, group: GroupSnapshot, now: float) -> None:
        self._group = (group, now)
        self._redraw()

    def _redraw(self) -> None:
        if self._group is not None:
            note = (None if self.ended else self.note) or self._standing
            self.show(header_text(*self._group, note=note, width=self.size.width))

    watch_note = watch_ended = _redraw


class RankPane(Vertical):
    """One rank: a one-line title bar over its output."""

    # Its title and its output cover it whole, so nothing of its own shows: drawn as blank rows,
    # not through Textual's per-row styling, which it went through on every frame that redrew
    # the pane (every other tick, for each of its rows: a twentieth of the TUI's frame).
    BLANK = True

    class Picked(Message):
        """The user clicked this pane."""

        def __init__(self, local_rank: int) -> None:
            super().__init__()
            self.local_rank = local_rank

    def __init__(self, local_rank: int, *, id: str | None = None, focused: bool = False) -> None:
        super().__init__(id=id, classes="pane focused" if focused else "pane")
        self.local_rank = local_rank
        # Held rather than queried: every tick reads both for each pane shown (a query walks the DOM).
        self._title = LiveText(classes="title")
        self._log = LogView(None, id=f"log-{local_rank}")

    def compose(self) -> ComposeResult:
        if self._log.parent is None:  # (not mounted already by mount_parts)
            yield self._title
            yield self._log

    def mount_parts(self) -> None:
        """Mount the title and the log at once, once this pane is in the DOM, rather than when its
        own task composes it: a focus asked for in the same breath (a rank shown for the first
        time) would find its log in no screen, and be lost."""
        self.mount(self._title, self._log)

    @property
    def log(self) -> LogView:
        return self._log

    @property
    def title(self) -> str:
        """The title as plain text."""
        return self._title.plain

    @property
    def title_width(self) -> int:
        return self._title.size.width

    def set_title(self, text: Text) -> None:
        self._title.show(text)

    def on_click(self, event: Click) -> None:
        self.post_message(self.Picked(self.local_rank))


# The compact list's orders and filters: (name, key) and (name, which states pass).
_STATE_ORDER = {state: i for i, state in enumerate((
    RankState.FAILED, RankState.UNREAPABLE, RankState.STALLED, RankState.STOPPING, RankState.STARTING,
    RankState.RUNNING, RankState.UNKNOWN, RankState.KILLED, RankState.SUCCEEDED))}
SORTS = ("rank", "state", "cpu", "quiet")
FILTERS = ("all", "problems", "running")


def _sort_key(sort: str, now: float):
    def key(snap: RankSnapshot) -> tuple:
        if sort == "state":  # the ones that need a look first; those that wait with the stalled
            order = _STATE_ORDER[RankState.STALLED] if waits(snap) else _STATE_ORDER[snap.state]
            return (order, snap.rank)
        if sort == "cpu":
            return (-(snap.cpu_percent or 0.0), snap.rank)
        if sort == "quiet":  # the longest silent first; the dead after the living
            age = last_output_age(snap, now)
            return (age is None, -(age or 0.0), snap.rank)
        return (snap.rank,)
    return key


def _passes(filter_: str, snap: RankSnapshot) -> bool:
    if filter_ == "problems":
        return snap.state in (RankState.FAILED, RankState.STALLED, RankState.UNREAPABLE) or waits(snap)
    if filter_ == "running":
        return snap.state.alive
    return True


def list_order(ranks: tuple[RankSnapshot, ...], sort: str, filter_: str, now: float) -> list[RankSnapshot]:
    """The ranks the compact list shows, in its order."""
    return sorted((r for r in ranks if _passes(filter_, r)), key=_sort_key(sort, now))


STATE_CELLS = 14  # the rank list's state column ("stalled 1m03s")
# The rank list's columns after the state, most telling first, with their cells: where the list
# is narrow the last go whole (the row was cut at its end: the metric's value and its `!` first).
LIST_COLUMNS = (("metric", 11), ("hits", 5), ("cpu", 6), ("age", 7))


def list_columns(room: int, hits: bool, metric: bool) -> set[str]:
    """The optional columns of the rank list that fit in `room` cells (every one before the list
    is laid out: room <= 0), most telling first."""
    wanted = [(name, cells) for name, cells in LIST_COLUMNS
              if (name != "hits" or hits) and (name != "metric" or metric)]
    if room <= 0:
        return {name for name, _ in wanted}
    kept: set[str] = set()
    for name, cells in wanted:
        if cells <= room:
            kept.add(name)
            room -= cells
    return kept


def list_head(shown: int, total: int, sort: str, filter_: str) -> Text:
    """The rank list's header row: how many ranks it shows, its order and its filter."""
    head = f"{shown}/{total} by {sort}" + ("" if filter_ == "all" else f", {filter_}")
    return Text(f" {head}  (s sort, v filter)", style="dim", no_wrap=True, overflow="ellipsis")


class RankList(LiveText):
    """The compact view: one row per rank (state, cpu, last output age), for many ranks. Its
    header row (list_head) is a widget of its own, docked above it, so that it stays on screen
    however far the list is scrolled."""

    class Picked(Message):
        def __init__(self, local_rank: int) -> None:
            super().__init__()
            self.local_rank = local_rank

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.order: list[int] = []  # local ranks, one per row

    def show_ranks(self, ranks: tuple[RankSnapshot, ...], focused: int, now: float, *, sort: str = "rank",
                   filter_: str = "all", hits: dict[int, int] | None = None,
                   metrics: dict[int, str] | None = None, outliers: set[int] | frozenset[int] = frozenset()) -> None:
        shown = list_order(ranks, sort, filter_, now)
        text = Text(no_wrap=True, overflow="ellipsis")
        digits = len(str(max((r.rank for r in ranks), default=0)))
        self.order = [r.local_rank for r in shown]
        columns = list_columns(self.size.width - (2 + digits + STATE_CELLS), hits is not None, metrics is not None)
        for snap in shown:
            mark = "▶" if snap.local_rank == focused else " "
            text.append(f"{mark}{snap.rank:>{digits}} ", style="bold reverse" if snap.local_rank == focused else "bold")
            text.append(f"{state_label(snap):<{STATE_CELLS}.{STATE_CELLS}}", style=state_style(snap))
            if "cpu" in columns:
                cpu = "-" if snap.cpu_percent is None else f"{snap.cpu_percent:.0f}%"
                text.append(f" {cpu:>5}")
            if "age" in columns:
                text.append(f" {human_age(last_output_age(snap, now)):>6}", style="dim")
            if "hits" in columns and hits is not None:
                count = hits.get(snap.local_rank, 0)
                text.append(f" {count:>4}", style="bold reverse" if count else "dim")
            if "metric" in columns and metrics is not None:
                odd = snap.local_rank in outliers
                text.append(f" {metrics.get(snap.local_rank, '-'):>9.9}{'!' if odd else ' '}",
                            style="bold reverse" if odd else "cyan")
            text.append("\n")
        text.rstrip()
        self.show(text)

    def row_of(self, local_rank: int) -> int | None:
        """The list row (0: the first rank's) showing `local_rank`, None when filtered out."""
        return self.order.index(local_rank) if local_rank in self.order else None

    def on_click(self, event: Click) -> None:
        row = event.y
        if 0 <= row < len(self.order):
            self.post_message(self.Picked(self.order[row]))
