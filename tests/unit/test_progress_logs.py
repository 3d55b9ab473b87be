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
