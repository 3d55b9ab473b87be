"""structlog setup for every Gyre process.

``setup_logging`` is called once, in a process's ``main()``; modules only call ``get_logger`` and
bind ids (``job_id``, ``execution_id``, ``cell_id``) to the logger they got.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import structlog


class _Sink:
    """Where this process's log lines go: the current ``sys.stderr``, or a file while a live
    progress display owns the terminal (`logs_to_file`), counting the lines sent there.

    Whole lines only: a thread's text is held until its newline and each line is written in one
    call under one lock, so two loggers (structlog prints a line and its newline in two writes;
    stdlib handlers have a lock of their own) never interleave inside a line."""

    def __init__(self) -> None:
        self.file: IO[str] | None = None
        self.lines = 0
        self._lock = threading.Lock()
        self._partial = threading.local()

    def write(self, text: str) -> int:
        held = getattr(self._partial, "text", "") + text
        head, newline, tail = held.rpartition("\n")
        self._partial.text = tail
        if newline:
            with self._lock:
                if self.file is None:
                    sys.stderr.write(head + newline)
                else:
                    self.lines += head.count("\n") + 1
                    self.file.write(head + newline)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            (self.file or sys.stderr).flush()


_SINK = _Sink()


@contextmanager
def logs_to_file(path: str | Path) -> Iterator[_Sink]:
    """Inside the block this process's log lines are appended to ``path`` instead of stderr (a live
    display keeps the terminal); yields the sink, whose ``lines`` counts them."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        with _SINK._lock:
            previous, _SINK.file, _SINK.lines = _SINK.file, f, 0
        try:
            yield _SINK
        finally:
            with _SINK._lock:
                _SINK.file = previous


def setup_logging(*, json: bool = True, level: str = "INFO", service: str = "") -> None:
    """Configure structlog (and the stdlib root logger it renders through) for this process.

    ``json=True`` renders one JSON object per line (for log shippers); otherwise a console renderer.
    ``service`` is bound to every line so merged logs stay attributable.
    """
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING or ERROR")
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    if service:
        processors.insert(0, _bind_service(service))
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_SINK),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    # stdlib records (grpc's Python side, transformers, torch, warnings) render through the same
    # processors: one JSON line each too, with level, logger name, timestamp and service
    handler = logging.StreamHandler(_SINK)  # type: ignore[arg-type]
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[_record_name, *processors],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(numeric)
    logging.captureWarnings(True)
    # an exception nothing caught (a process's main, a thread) is one JSON line too, not a bare traceback
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback,  # type: ignore[arg-type]
                                                   thread=getattr(a.thread, "name", ""))
    if json:
        _no_progress_bars()


def _no_progress_bars() -> None:
    """A JSON log is no progress display: no tqdm bars (transformers' "Loading weights", hub
    downloads) in it, whoever started the process (a systemd unit, a cell daemon's train command)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when those libraries are imported
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()
    if "huggingface_hub.utils" in sys.modules:
        sys.modules["huggingface_hub.utils"].disable_progress_bars()


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: Any, thread: str = "") -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    structlog.get_logger("uncaught", logger_name="uncaught").critical(
        "uncaught exception", thread=thread or None, exc_info=(exc_type, exc, tb))


def _record_name(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A stdlib record's logger name under the key Gyre's own lines use (``logger_name``)."""
    record = event.get("_record")
    if record is not None:
        event.setdefault("logger_name", record.name)
    return event


def _bind_service(service: str) -> Any:
    def processor(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("service", service)
        return event

    return processor


def get_logger(name: str, **ids: Any) -> Any:
    """A structlog logger named ``name`` with ``ids`` (job_id, execution_id, cell_id...) bound."""
    # initial values on the lazy proxy (not .bind()) so configuration made later in main() applies
    return structlog.get_logger(name, logger_name=name, **ids)
