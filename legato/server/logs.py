"""Structured logs: every record made while a request is served carries its request id.

The request-id middleware sets a context variable; `RequestIdFilter` copies it onto each record (so any
module's logger, not only the server's, tags its lines), and the two formatters write either text with
`key=value` extras or one JSON object per line.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)

# Attributes every LogRecord has; anything else on a record came from `extra=` and is logged as a field.
# (uvicorn adds `color_message`, the same text with ANSI colours, to its own records.)
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_id", "taskName", "color_message"}


class RequestIdFilter(logging.Filter):
    """Tags records with the request id, and with the front process (`front=k`) of a server of several."""

    def __init__(self, front: int | None = None) -> None:
        super().__init__()
        self.front = front

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request_id.get()
        if self.front is not None:
            record.front = self.front
        return True


def _extras(record: logging.LogRecord) -> dict:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class TextFormatter(logging.Formatter):
    """`time level logger [request_id] message key=value ...`"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(rid)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        rid = getattr(record, "request_id", None)
        record.rid = f" [{rid}]" if rid else ""
        line = super().format(record)
        del record.rid
        extras = {k: v for k, v in _extras(record).items() if k != "rid" and v is not None}
        if extras:
            line += " " + " ".join(f"{k}={_short(v)}" for k, v in extras.items())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, request_id, msg, the extras, and exc if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", None),
            "msg": record.getMessage(),
        }
        out.update(_extras(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def _short(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if " " not in text else json.dumps(text)


def configure_logging(fmt: str = "text", level: str = "INFO", front: int | None = None) -> None:
    """Routes the root logger (and uvicorn's) through one handler with request ids (and `front`, for a
    server of several front processes, whose lines meet in one stream)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter(front))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
