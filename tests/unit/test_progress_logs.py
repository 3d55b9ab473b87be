"""While a live progress table owns the terminal, log lines go to a file and the table counts them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import io, json, logging, sys, warnings
from rich.console import Console
from services.common.logging import get_logger, logs_to_file, setup_logging
from services.jobwatch import JobView
from services.progress import Progress

setup_logging(json=True, level="WARNING", service="gyre run")
log = get_logger("test")
log.warning("before the table")                      # stderr: no table yet

class Scheduler:
    def get_job(self, job_id):
        raise ConnectionError("down")                 # the table shows the last known figures

screen = io.StringIO()
progress = Progress(Scheduler(), JobView(job_id="job-1"), log_path=sys.argv[1], echo=lambda m: print(m))
progress.console = Console(file=screen, force_terminal=True, width=160)
with progress:
    log.warning("model call unavailable; retrying", attempt=1)
    logging.getLogger("grpc").error("a stdlib record")
    warnings.warn("a Python warning")
    progress.update(force=True)
    rendered = Console(file=io.StringIO(), width=160)
    rendered.print(progress._table())
    table = rendered.file.getvalue()
log.warning("after the table")                       # stderr again
print(json.dumps({"table": table, "screen_has_log": "retrying" in screen.getvalue()}))
"""


def test_log_lines_go_to_the_file_while_the_table_is_live(tmp_path: Path) -> None:
    log_file = tmp_path / "logs" / "gyre-run.log"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(log_file)], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip().splitlines()
    result = json.loads(out[-1])
    assert "log lines" in result["table"] and "3 (warnings and errors of this command" in result["table"]
    assert not result["screen_has_log"]
    assert any(line == f"3 log line(s) of this command are in {log_file}" for line in out)
    diverted = [json.loads(x) for x in log_file.read_text().splitlines()]
    assert [d["event"] for d in diverted][:2] == ["model call unavailable; retrying", "a stdlib record"]
    assert "a Python warning" in diverted[2]["event"] and all(d["service"] == "gyre run" for d in diverted)
    errs = [json.loads(x)["event"] for x in proc.stderr.splitlines() if x.startswith("{")]
    assert errs == ["before the table", "after the table"]  # nothing else printed while the table showed


def test_lines_from_two_writers_never_interleave(tmp_path: Path) -> None:
    """structlog prints a line and its newline in two writes under its own lock, a stdlib handler
    writes a whole line under another: the sink still writes whole lines only."""
    import threading

    from services.common.logging import _SINK, logs_to_file

    def printer() -> None:
        for i in range(2000):
            print(json.dumps({"w": "print", "i": i}), file=_SINK, flush=True)  # type: ignore[arg-type]

    def handler() -> None:
        for i in range(2000):
            _SINK.write(json.dumps({"w": "handler", "i": i}) + "\n")

    path = tmp_path / "log"
    with logs_to_file(path) as sink:
        threads = [threading.Thread(target=printer), threading.Thread(target=handler)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sink.lines == 4000
    lines = [json.loads(x) for x in path.read_text().splitlines()]  # every line whole JSON
    assert sorted((d["w"], d["i"]) for d in lines) == sorted((w, i) for w in ("print", "handler") for i in range(2000))
