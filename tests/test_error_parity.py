"""ranktop.core.errors beside torch 2.13's torch.distributed.elastic.multiprocessing.errors: the
same files go through both, and what each writes, returns or raises is compared. The behaviours
are those torch's own tests check (errors/api_test.py, error_handler_test.py), plus the guards
ranktop keeps because a rank's error file is input the rank controls."""

from __future__ import annotations

import filecmp
import json
import os
import pickle
import signal
import sys
import textwrap

import pytest
from conftest import run_ranktop
from ranktop.core import errors as R

T = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors")
TorchHandler = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors.error_handler").ErrorHandler

ENV = "TORCHELASTIC_ERROR_FILE"


class SentinelError(Exception):
    pass


def _recorded(path, monkeypatch, exc: BaseException) -> None:
    """An error file as @record writes it, through ranktop's handler."""
    monkeypatch.setenv(ENV, str(path))
    try:
        raise exc
    except BaseException as raised:
        R.ErrorHandler().record_exception(raised)
    monkeypatch.delenv(ENV)


def _rich_rank_file(path) -> dict:
    """A rank's file with more than @record writes: traits, an extra extraInfo key, a top key."""
    data = {"message": {"message": "RuntimeError: oom", "errorTraits": {"category": "user", "retryability": "True"},
                        "extraInfo": {"py_callstack": "Traceback...\nRuntimeError: oom", "timestamp": "1700000000",
                                      "device": "cuda:3"}},
            "jobTag": "nightly"}
    path.write_text(json.dumps(data))
    return data


# ----- ErrorHandler.dump_error_file / override_error_code_in_rootcause_data ----------------------

def test_dump_error_file_copies_the_file_as_torch_does_every_key_kept(tmp_path, monkeypatch):
    src = tmp_path / "rank.json"
    _rich_rank_file(src)
    outputs = {}
    for side, handler in (("torch", TorchHandler()), ("ranktop", R.ErrorHandler())):
        for code in (0, -11):
            dest = tmp_path / f"{side}{code}.json"
            monkeypatch.setenv(ENV, str(dest))
            handler.dump_error_file(str(src), code)
            outputs[side, code] = dest.read_bytes()
    # error code 0 means "not known": the file is copied byte for byte (torch's filecmp test)
    assert filecmp.cmp(src, tmp_path / "ranktop0.json", shallow=False)
    assert outputs["ranktop", 0] == outputs["torch", 0]
    # a nonzero code goes into message.errorCode; every other key is kept where it was
    assert outputs["ranktop", -11] == outputs["torch", -11]
    copied = json.loads(outputs["ranktop", -11])
    assert copied["message"]["errorCode"] == -11 and copied["message"]["errorTraits"]["category"] == "user"
    assert copied["message"]["extraInfo"]["device"] == "cuda:3" and copied["jobTag"] == "nightly"
    assert "errorCode" not in copied["message"]["extraInfo"]


def test_dump_error_file_of_what_record_wrote_and_of_a_plain_message_file(tmp_path, monkeypatch):
    src = tmp_path / "rank.json"
    for make in (lambda: _recorded(src, monkeypatch, SentinelError("foobar")),
                 lambda: src.write_text(json.dumps({"message": "plain text", "timestamp": 10})),
                 lambda: src.write_text(json.dumps({"message": {"message": "x", "errorCode": 7}}))):
        make()
        for side, handler in (("torch", TorchHandler()), ("ranktop", R.ErrorHandler())):
            monkeypatch.setenv(ENV, str(tmp_path / f"{side}.json"))
            handler.dump_error_file(str(src), 9)
        # a plain-text message has no place for the code and is left as it is; an errorCode
        # the rank wrote is replaced by the one the launcher saw
        assert (tmp_path / "ranktop.json").read_bytes() == (tmp_path / "torch.json").read_bytes()


def test_dump_error_file_overwrites_an_existing_file(tmp_path, monkeypatch):
    dest, src = tmp_path / "dst.json", tmp_path / "src.json"
    _recorded(dest, monkeypatch, RuntimeError("foo"))
    _recorded(src, monkeypatch, RuntimeError("bar"))
    monkeypatch.setenv(ENV, str(dest))
    R.ErrorHandler().dump_error_file(str(src))
    assert filecmp.cmp(src, dest, shallow=False)
    assert sorted(os.listdir(tmp_path)) == ["dst.json", "src.json"]  # no temporary file left


def test_dump_error_file_without_a_launcher_file_reads_and_writes_nothing(tmp_path, monkeypatch):
    src = tmp_path / "src.json"
    _recorded(src, monkeypatch, RuntimeError("bar"))
    monkeypatch.delenv(ENV, raising=False)
    R.ErrorHandler().dump_error_file(str(src), 1)
    assert os.listdir(tmp_path) == ["src.json"]


def test_dump_error_file_of_a_missing_file_raises_file_not_found_as_torch(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "dst.json"))
    with pytest.raises(FileNotFoundError):
        TorchHandler().dump_error_file(str(tmp_path / "gone.json"))
    with pytest.raises(FileNotFoundError, match="gone.json"):
        R.ErrorHandler().dump_error_file(str(tmp_path / "gone.json"))
    assert not (tmp_path / "dst.json").exists()


def test_dump_error_file_refuses_a_hostile_rank_file_and_leaves_ours_alone(tmp_path, monkeypatch):
    dest = tmp_path / "dst.json"
    dest.write_text("before")
    monkeypatch.setenv(ENV, str(dest))
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"message": "root's only"}))
    (tmp_path / "link.json").symlink_to(secret)
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "big.json").write_text(json.dumps({"message": "x" * (R.ERROR_FILE_LIMIT + 1)}))
    (tmp_path / "bad.json").write_text("{not json")
    cases = {"link.json": "is a symlink", "fifo.json": r"is not a regular file \(a FIFO\)",
             "big.json": "is larger than 1 MB", "bad.json": "is not valid JSON"}
    for name, why in cases.items():
        with pytest.raises(R.BadErrorFile, match=why):
            R.ErrorHandler().dump_error_file(str(tmp_path / name), 1)
        assert dest.read_text() == "before", name
    # bad JSON is what torch raises json.JSONDecodeError for: ours is one too
    with pytest.raises(json.JSONDecodeError):
        TorchHandler().dump_error_file(str(tmp_path / "bad.json"))
    with pytest.raises(json.JSONDecodeError):
        R.ErrorHandler().dump_error_file(str(tmp_path / "bad.json"))


def test_dump_error_file_never_writes_through_what_is_planted_at_our_name(tmp_path, monkeypatch):
    src = tmp_path / "src.json"
    data = _rich_rank_file(src)
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    dest = tmp_path / "dst.json"
    monkeypatch.setenv(ENV, str(dest))
    for plant in (lambda: dest.symlink_to(victim), lambda: os.link(victim, dest)):
        plant()
        R.ErrorHandler().dump_error_file(str(src), 0)
        assert victim.read_text() == "keep me"  # neither the link's target nor a hard link's twin
        assert not dest.is_symlink() and json.loads(dest.read_text()) == data
        assert os.stat(dest).st_ino != os.stat(victim).st_ino
        dest.unlink()
    dest.mkdir()
    for handler in (TorchHandler(), R.ErrorHandler()):  # a copy not written is a warning, as torch's
        with pytest.warns(UserWarning, match="Unable to write error to file. IsADirectoryError"):
            handler.dump_error_file(str(src), 0)
    assert sorted(os.listdir(tmp_path)) == ["dst.json", "src.json", "victim"]  # the temporary file removed


def test_record_replaces_what_is_planted_at_the_error_file_never_writing_through(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    dest = run / "error.json"
    monkeypatch.setenv(ENV, str(dest))
    dest.symlink_to(victim)
    # the names a temporary file once had (<file>.tmp<pid>) planted too: they neither block nor leak
    for pid in {os.getpid(), os.getppid()}:
        (run / f"error.json.tmp{pid}").symlink_to(victim)
    with pytest.raises(SentinelError):
        R.record(_raise_sentinel)()
    assert victim.read_text() == "keep me"
    assert not dest.is_symlink() and json.loads(dest.read_text())["message"]["message"] == "SentinelError: foobar"
    assert oct(os.stat(dest).st_mode & 0o777) == oct(0o600)
    assert sorted(os.listdir(run)) == sorted(["error.json", *(f"error.json.tmp{p}" for p in {os.getpid(), os.getppid()})])


def test_a_failed_error_file_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    src = tmp_path / "src.json"
    _rich_rank_file(src)
    dest = tmp_path / "dest"
    dest.mkdir()  # the rename onto it fails
    monkeypatch.setenv(ENV, str(dest))
    for record in (T.record, R.record):  # the write's error goes up, the rank's behind it, as torch's
        with pytest.raises(IsADirectoryError) as raised:
            record(_raise_sentinel)()
        assert isinstance(raised.value.__context__, SentinelError)
        # naming the file asked for, as torch's: ours named its temporary file, '.dest.1a2b3c4d.tmp' -> 'dest'
        assert str(raised.value) == f"[Errno 21] Is a directory: {str(dest)!r}"
    with pytest.warns(UserWarning, match=f"IsADirectoryError: \\[Errno 21\\] Is a directory: '{dest}'$"):
        R.ErrorHandler().dump_error_file(str(src), 3)
    monkeypatch.setenv(ENV, str(tmp_path / "missing" / "error.json"))
    for record in (T.record, R.record):
        with pytest.raises(FileNotFoundError) as raised:
            record(_raise_sentinel)()
        assert str(raised.value) == f"[Errno 2] No such file or directory: {str(tmp_path / 'missing' / 'error.json')!r}"
    assert sorted(os.listdir(tmp_path)) == ["dest", "src.json"] and os.listdir(dest) == []
    # and the copy that does land is private
    monkeypatch.setenv(ENV, str(tmp_path / "copy.json"))
    R.ErrorHandler().dump_error_file(str(src), 3)
    assert oct(os.stat(tmp_path / "copy.json").st_mode & 0o777) == oct(0o600)


def test_override_error_code_in_rootcause_data_as_torch(tmp_path):
    for loaded in ({"message": {"message": "m", "extraInfo": {}}}, {"message": "plain"}, {"other": 1},
                   {"message": {"message": "m", "errorCode": 3}}):
        ours, theirs = json.loads(json.dumps(loaded)), json.loads(json.dumps(loaded))
        R.ErrorHandler().override_error_code_in_rootcause_data("f.json", ours, -9)
        TorchHandler().override_error_code_in_rootcause_data("f.json", theirs, -9)
        assert ours == theirs
    assert R.get_error_handler().__class__ is R.ErrorHandler


# ----- record ------------------------------------------------------------------------------------

class ToFile(R.ErrorHandler):
    """A handler that keeps its own file, as a torch user's subclass would."""

    def __init__(self, path) -> None:
        self.path, self.initialized = str(path), 0

    def initialize(self) -> None:
        self.initialized += 1

    def _get_error_file_path(self) -> str:
        return self.path


def _raise_sentinel() -> None:
    raise SentinelError("foobar")


def test_record_takes_torchs_error_handler_keyword(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    handler = ToFile(tmp_path / "mine.json")
    with pytest.raises(SentinelError):
        R.record(_raise_sentinel, error_handler=handler)()
    assert handler.initialized == 1
    err = json.loads((tmp_path / "mine.json").read_text())
    assert err["message"]["message"] == "SentinelError: foobar" and "_raise_sentinel" in err["message"]["extraInfo"]["py_callstack"]
    # the plain handler, positionally as torch allows, goes by the environment
    monkeypatch.setenv(ENV, str(tmp_path / "env.json"))
    with pytest.raises(SentinelError):
        R.record(_raise_sentinel, R.ErrorHandler())()
    assert json.loads((tmp_path / "env.json").read_text())["message"]["message"] == "SentinelError: foobar"
    # ranktop's older keyword still names a file of its own
    with pytest.raises(SentinelError):
        R.record(_raise_sentinel, error_file=str(tmp_path / "old.json"))()
    assert json.loads((tmp_path / "old.json").read_text())["message"]["message"] == "SentinelError: foobar"


def _leave(code):
    raise SystemExit(code)


@pytest.mark.parametrize("code", [0, False, None, 1, 138, "text"])
def test_record_returns_normally_only_for_what_torch_does_and_writes_no_file(tmp_path, monkeypatch, code):
    ends = {}
    for side, record in (("torch", T.record), ("ranktop", R.record)):
        monkeypatch.setenv(ENV, str(tmp_path / f"{side}.json"))
        try:
            ends[side] = ("returned", record(_leave)(code))
        except SystemExit as exc:
            ends[side] = ("raised", exc.code)
    # torch tests `code == 0`: a bare sys.exit() (None) goes up as every other code does
    assert ends["ranktop"] == ends["torch"] == (("returned", None) if code == 0 else ("raised", code))
    assert os.listdir(tmp_path) == []
    assert R.record(lambda: 5)() == 5


def _child_failed(side, name: str, child_file: str):
    failure = side.ProcessFailure(local_rank=0, pid=997, exitcode=1, error_file=child_file)
    raise side.ChildFailedError(name, {0: failure})


def test_record_passes_a_child_failure_up_as_torch(tmp_path, monkeypatch):
    child = tmp_path / "trainer" / "0" / "error.json"
    child.parent.mkdir(parents=True)
    _recorded(child, monkeypatch, SentinelError("in the child"))
    for side, record in (("torch", T.record), ("ranktop", R.record)):
        monkeypatch.setenv(ENV, str(tmp_path / f"{side}.json"))
        with pytest.raises((T.ChildFailedError, R.ChildFailedError)):
            record(_child_failed)(T if side == "torch" else R, "trainer", str(child))
    # the child's file, errorCode added: not the ChildFailedError itself
    expected = json.loads(child.read_text())
    expected["message"]["errorCode"] = 1
    assert json.loads((tmp_path / "ranktop.json").read_text()) == expected
    assert (tmp_path / "ranktop.json").read_bytes() == (tmp_path / "torch.json").read_bytes()
    # no child file: nothing is written, the ChildFailedError still goes up
    monkeypatch.setenv(ENV, str(tmp_path / "none.json"))
    with pytest.raises(R.ChildFailedError):
        R.record(_child_failed)(R, "trainer", str(tmp_path / "missing.json"))
    assert not (tmp_path / "none.json").exists()


def test_record_passes_a_child_failure_up_when_the_launcher_file_cannot_be_written(tmp_path, monkeypatch):
    # torch warns and lets the rank's failure go up; ranktop's copy raised in its place (a missing
    # directory, or one another user controls, ranktop refuses to go through)
    child = tmp_path / "0" / "error.json"
    child.parent.mkdir()
    _recorded(child, monkeypatch, SentinelError("in the child"))
    monkeypatch.setenv(ENV, str(tmp_path / "gone" / "launcher.json"))
    for side, record in (("torch", T.record), ("ranktop", R.record)):
        with pytest.warns(UserWarning, match="Unable to write error to file"):
            with pytest.raises((T.ChildFailedError, R.ChildFailedError)):
                record(_child_failed)(T if side == "torch" else R, "trainer", str(child))
    assert not (tmp_path / "gone").exists()


# ----- ProcessFailure ----------------------------------------------------------------------------

def test_process_failure_message_is_torchs_with_the_text_beside_it(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    _recorded(path, monkeypatch, SentinelError("foobar"))
    ours, theirs = R.ProcessFailure(0, 997, 1, str(path)), T.ProcessFailure(0, 997, 1, str(path))
    assert isinstance(ours.message, dict) and ours.message == theirs.message
    assert ours.message_text == "SentinelError: foobar" and "Traceback" in ours.traceback
    assert (ours.timestamp, ours.error_file_data, ours.error_file) == (theirs.timestamp, theirs.error_file_data, str(path))
    assert ours.error_file_data["message"]["extraInfo"]["timestamp"] == str(ours.timestamp)
    assert ours.timestamp_isoformat() == theirs.timestamp_isoformat() and "_" in ours.timestamp_isoformat()
    assert ours.signal_name() == theirs.signal_name() == "<N/A>"
    for stamp in (10, "10"):  # torch's "new" and "mast" plain formats
        path.write_text(json.dumps({"message": "test error message", "timestamp": stamp}))
        ours, theirs = R.ProcessFailure(0, 997, 1, str(path)), T.ProcessFailure(0, 997, 1, str(path))
        assert (ours.message, ours.timestamp) == (theirs.message, theirs.timestamp) == ("test error message", 10)
        assert ours.message_text == "test error message"


def test_process_failure_without_an_error_file_has_torchs_data(tmp_path):
    missing = str(tmp_path / "ignored.json")
    ours, theirs = R.ProcessFailure(0, 997, 138, missing), T.ProcessFailure(0, 997, 138, missing)
    assert ours.error_file == theirs.error_file == "<N/A>"
    assert ours.error_file_data == theirs.error_file_data == {
        "message": "<NONE>", "errorTraits": {"category": "system_terminated_error", "retryability": "False"}}
    ours.error_file_data["errorTraits"]["category"] = "changed"  # each failure has its own copy
    assert R.ProcessFailure(0, 997, 138, missing).error_file_data["errorTraits"]["category"] == "system_terminated_error"
    assert ours.message_text == ours.message and "exited with code 138" in ours.message
    killed = R.ProcessFailure(0, 997, -signal.SIGSEGV, missing)
    assert killed.signal_name() == "SIGSEGV" and killed.error_file_data == {"message": "<NONE>"}
    assert killed.message == T.ProcessFailure(0, 997, -signal.SIGSEGV, missing).message \
        == f"Signal {int(signal.SIGSEGV)} (SIGSEGV) received by PID 997"


def test_a_malformed_file_raises_what_torch_raises_and_stays_a_bad_error_file(tmp_path):
    path = tmp_path / "error.json"
    path.write_text("{not json")
    with pytest.raises(json.JSONDecodeError):
        T.ProcessFailure(0, 997, 1, str(path))
    with pytest.raises(json.JSONDecodeError) as raised:
        R.ProcessFailure(0, 997, 1, str(path))
    exc = raised.value
    assert isinstance(exc, R.BadErrorFile) and isinstance(exc, ValueError)
    assert str(exc) == f"error file {path} is not valid JSON" and (exc.lineno, exc.colno, exc.pos) == (1, 2, 1)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is type(exc) and str(again) == str(exc) and again.pos == 1
    path.write_bytes(b'{"message": "\xff"}')  # not UTF-8
    with pytest.raises(json.JSONDecodeError, match="is not valid JSON"):
        R.ProcessFailure(0, 997, 1, str(path))
    path.write_text(json.dumps({"unknown_key": "unknown_value"}))
    with pytest.raises(KeyError):
        T.ProcessFailure(0, 997, 1, str(path))
    with pytest.raises(KeyError) as raised:
        R.ProcessFailure(0, 997, 1, str(path))
    assert isinstance(raised.value, R.BadErrorFile)
    assert str(raised.value) == f'error file {path} has no "message" object at the top'  # unquoted, unlike KeyError's
    path.write_text("[1, 2]")
    with pytest.raises(R.BadErrorFile, match='has no "message" object at the top'):
        R.ProcessFailure(0, 997, 1, str(path))
    # the engine's way: the problem is named, nothing raised, no file data kept
    path.write_text("{not json")
    named = R.ProcessFailure(0, 997, 1, str(path), raise_bad_file=False)
    assert named.message == named.message_text == f"exited with code 1; error file {path} is not valid JSON; ignored"
    assert named.error_file == str(path) and not named.error_file_read and named.error_file_data["message"] == "<NONE>"


HOSTILE_STAMPS = ["\u0661\u0662\u0663", "\u00b2", "9" * 13, "-1", "1e3", "", 10**30, R.MAX_TIMESTAMP + 1, 1e308,
                  float("inf"), float("nan"), -1, True, [1]]


@pytest.mark.parametrize("stamp", HOSTILE_STAMPS, ids=repr)
@pytest.mark.parametrize("shape", ["torch", "plain"])
def test_a_timestamp_that_is_no_time_is_a_bad_error_file(tmp_path, stamp, shape):
    path = tmp_path / "error.json"
    data = ({"message": {"message": "ValueError: x", "extraInfo": {"timestamp": stamp}}} if shape == "torch"
            else {"message": "x", "timestamp": stamp})
    path.write_text(json.dumps(data))  # inf and nan as JSON's Infinity and NaN, which json reads back
    with pytest.raises(R.BadErrorFile, match='has a "timestamp" that is not a number of seconds up to the year 9999'):
        R.ProcessFailure(0, 997, 1, str(path))
    named = R.ProcessFailure(0, 997, 1, str(path), raise_bad_file=False)  # the engine's way
    assert named.message.endswith('has a "timestamp" that is not a number of seconds up to the year 9999; ignored')
    assert not named.error_file_read and named.error_file_data["message"] == "<NONE>"
    assert named.timestamp_isoformat()  # the time the exit was seen, which formats
    assert R.read_error_file(path) is None


@pytest.mark.parametrize("stamp", ["1700000000", "0", "253370764800", 1700000000, 1700000000.5, 0, R.MAX_TIMESTAMP])
def test_a_timestamp_of_seconds_is_taken(tmp_path, stamp):
    path = tmp_path / "error.json"
    path.write_text(json.dumps({"message": {"message": "ValueError: x", "extraInfo": {"timestamp": stamp}}}))
    failure = R.ProcessFailure(0, 997, 1, str(path))
    assert failure.timestamp == int(stamp) and failure.timestamp_isoformat()


def test_signal_name_is_torchs_for_named_unnamed_and_no_signal():
    for code in (-signal.SIGSEGV, -signal.SIGKILL, -(signal.SIGRTMIN + 6), -200, 1, 0):
        ours = R.ProcessFailure(0, 997, code, "/nonexistent").signal_name()
        assert ours == T.ProcessFailure(0, 997, code, "/nonexistent").signal_name(), code
    assert R.ProcessFailure(0, 997, -(signal.SIGRTMIN + 6), "/nonexistent").signal_name() == "<N/A>"


# ----- ChildFailedError --------------------------------------------------------------------------

def _same_failures(tmp_path, monkeypatch):
    """The same three failures made by both sides: two @record files and a signal."""
    made = {"ranktop": {}, "torch": {}}
    for rank in (0, 1):
        path = tmp_path / f"error{rank}.json"
        _recorded(path, monkeypatch, SentinelError(f"rank {rank}\nsecond line"))
        made["ranktop"][rank] = R.ProcessFailure(rank, 900 + rank, 1, str(path))
        made["torch"][rank] = T.ProcessFailure(rank, 900 + rank, 1, str(path))
    missing = str(tmp_path / "none.json")
    made["ranktop"][2] = R.ProcessFailure(2, 902, -signal.SIGSEGV, missing)
    made["torch"][2] = T.ProcessFailure(2, 902, -signal.SIGSEGV, missing)
    made["torch"][2].timestamp = made["ranktop"][2].timestamp  # torch's is "now" when made
    return made["ranktop"], made["torch"]


def test_child_failed_error_text_is_torchs_table(tmp_path, monkeypatch):
    ours, theirs = _same_failures(tmp_path, monkeypatch)
    ex, tex = R.ChildFailedError("trainer.par", ours), T.ChildFailedError("trainer.par", theirs)
    assert ex.get_first_failure() == (0, ours[0])
    assert str(ex) == str(tex) == ex.format_msg()
    assert ex.format_msg(boarder_delim="*", section_delim="~") == tex.format_msg(boarder_delim="*", section_delim="~")
    lines = str(ex).splitlines()
    assert lines[:5] == ["", "=" * 60, "trainer.par FAILED", "-" * 60, "Failures:"]  # capped at 60 wide
    root = lines.index("Root Cause (first observed failure):")
    assert lines[root + 1] == "[0]:" and lines[root + 4] == "  rank      : 0 (local_rank: 0)"
    assert "  traceback : Traceback (most recent call last):" in lines[root:]
    # the traceback's lines indented under it
    assert any(line.startswith("  ") and line.endswith("SentinelError: rank 0") for line in lines)
    assert "  second line" in lines
    assert f"  exitcode  : {-int(signal.SIGSEGV)} (pid: 902)  (SIGSEGV)" in lines
    assert "  error_file: <N/A>" in lines and lines[-1] == "=" * 60


def test_child_failed_error_one_failure_and_a_narrow_table(tmp_path):
    only = R.ProcessFailure(3, 77, -signal.SIGKILL, str(tmp_path / "none.json"))
    text = str(R.ChildFailedError("t", {5: only})).splitlines()
    assert "  <NO_OTHER_FAILURES>" in text and "  rank      : 5 (local_rank: 3)" in text
    width = max(len(line) for line in text if not line.startswith(("=", "-")))
    assert text[1] == "=" * min(width, 60)
    with pytest.raises(ValueError, match="at least one failure"):
        R.ChildFailedError("t", {})


def test_child_failed_error_orders_torchs_failures_by_timestamp(tmp_path):
    missing = str(tmp_path / "none.json")
    late, early = T.ProcessFailure(0, 1, -9, missing), T.ProcessFailure(1, 2, -15, missing)
    late.timestamp, early.timestamp = 200, 100
    assert R.ChildFailedError("t", {0: late, 1: early}).get_first_failure() == (1, early)


# ----- end to end: ranktop itself under a scheduler's TORCHELASTIC_ERROR_FILE --------------------

def test_the_scheduler_gets_the_rank_file_with_every_key_and_the_exit_code(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import json, os, sys
        with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
            json.dump({"message": {"message": "RuntimeError: oom", "errorTraits": {"category": "user"},
                                   "extraInfo": {"py_callstack": "tb", "timestamp": "1700000000", "node": "a"}},
                       "jobTag": "nightly"}, f)
        sys.exit(3)
    """))
    ours = tmp_path / "scheduler_error.json"
    done = run_ranktop("--headless", "--log-dir", str(tmp_path / "logs"), str(script),
                       env={**os.environ, ENV: str(ours)})
    assert done.returncode == 1, done.stderr  # torchrun's status for a failed group
    copied = json.loads(ours.read_text())
    assert copied == {"message": {"message": "RuntimeError: oom", "errorTraits": {"category": "user"}, "errorCode": 3,
                                  "extraInfo": {"py_callstack": "tb", "timestamp": "1700000000", "node": "a"}},
                      "jobTag": "nightly"}
    assert "RuntimeError: oom" in done.stderr  # the report shows the text, not the dict
    assert "{'message'" not in done.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
