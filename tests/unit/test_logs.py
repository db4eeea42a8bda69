"""Every service's log line carries its fields (``stagetree.logs``), and each service installs it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from stagetree.logs import KeyValueFormatter

ROOT = Path(__file__).resolve().parents[2]


def _record(msg: str, exc: bool = False, **extra: object) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    record = logging.LogRecord("x", logging.INFO, __file__, 1, msg, None, info)
    record.__dict__.update(extra)
    return record


def test_fields_follow_the_message_and_values_with_spaces_are_quoted() -> None:
    fmt = KeyValueFormatter("%(levelname)s %(message)s")
    assert (
        fmt.format(_record("worker exited", batch_id=7, returncode=-9)) == "INFO worker exited batch_id=7 returncode=-9"
    )
    line = fmt.format(_record("batch attempt ended", outcome="USER_ERROR", error="ValueError: bad x"))
    assert line == "INFO batch attempt ended outcome=USER_ERROR error='ValueError: bad x'"
    assert fmt.format(_record("plain")) == "INFO plain"


def test_a_traceback_stays_below_the_line_its_fields_belong_to() -> None:
    lines = KeyValueFormatter("%(message)s").format(_record("failed", exc=True, batch_id=3)).splitlines()
    assert lines[0] == "failed batch_id=3" and lines[1].startswith("Traceback") and lines[-1] == "ValueError: boom"


def test_every_service_entry_point_logs_through_it() -> None:
    for path in ("master/cli.py", "aggregator/cli.py", "nodemanager/cli.py", "nodemanager/runtime/worker.py",
                 "embedded.py", "cluster.py"):  # fmt: skip
        text = (ROOT / "services" / path).read_text()
        assert "logs.configure(" in text and "logging.basicConfig(" not in text, path


def test_a_process_logs_fields_end_to_end() -> None:
    code = (
        "import logging; from stagetree import logs; logs.configure('INFO');"
        "logging.getLogger('t').info('study created', extra={'study_id': 'abc', 'owner': 'alice'})"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stderr.rstrip().endswith("INFO t: study created study_id=abc owner=alice")
