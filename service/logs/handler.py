"""The logging handler: one JSON object per log record, plain ``extra=`` fields only."""

from __future__ import annotations

import logging
import traceback

import orjson

from service.logs.fields import plain, timestamp
from service.logs.writer import LineWriter

# Attributes every LogRecord has; anything else came from ``extra=`` and is a field of the line
# (except uvicorn's ``color_message``: the message again, with terminal colour codes).
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "color_message",
}


class JsonHandler(logging.Handler):
    """A logging handler writing one JSON object per record: ts, level, logger, msg, the
    ``extra=`` fields that are plain scalars, and for exceptions their type and frames only."""

    def __init__(self, writer: LineWriter) -> None:
        super().__init__()
        self._writer = writer

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line: dict[str, object] = {
                "ts": timestamp(record.created),
                "level": record.levelname.lower(),
                "logger": record.name,
                "msg": record.getMessage(),
            }
            for name, value in record.__dict__.items():
                if name not in _RECORD_ATTRIBUTES and name not in line:
                    shown = plain(value)
                    if shown is not None:
                        line[name] = shown
            if record.exc_info and record.exc_info[0] is not None:
                line["exc_type"] = record.exc_info[0].__name__
                frames = traceback.extract_tb(record.exc_info[2])
                line["frames"] = [f"{f.filename}:{f.lineno} in {f.name}" for f in frames]
            self._writer.write(orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE))
        except Exception:  # a log call must never raise into the code that logs
            self.handleError(record)
