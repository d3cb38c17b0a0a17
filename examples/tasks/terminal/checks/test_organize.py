"""term-organize-logs: .log files moved into logs/, count.txt holds their number."""
import pathlib

LOGS = {"boot.log", "error.log", "app.log"}


def test_logs_moved():
    assert {p.name for p in pathlib.Path("logs").glob("*.log")} == LOGS


def test_no_log_left_at_top():
    assert not list(pathlib.Path(".").glob("*.log"))


def test_log_contents_kept():
    assert pathlib.Path("logs/error.log").read_text() == "error: disk\n"


def test_other_files_stay():
    assert pathlib.Path("notes.txt").is_file() and pathlib.Path("README.md").is_file()


def test_count():
    assert pathlib.Path("count.txt").read_text().strip() == "3"
