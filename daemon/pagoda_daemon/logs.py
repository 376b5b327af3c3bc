"""Log lines as people and log pipelines read them: ``text`` (the default) or ``json`` (one
object per line: time, level, logger, process role, message, and the request id where a line
is about one request).

Every process of the daemon configures logging through :func:`configure`; the format chosen on
the command line travels to the engine core and the tensor-parallel ranks in
``PAGODA_LOG_FORMAT``, so all of them write the same shape.
"""

from __future__ import annotations

import json
import logging
import os
import time

FORMATS = ("text", "json")
FORMAT_ENV = "PAGODA_LOG_FORMAT"
LEVEL_ENV = "PAGODA_LOG_LEVEL"


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "process": self.role,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = request_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(level: str, role: str = "", log_format: str | None = None) -> None:
    """Root logging for this process: `role` names it in each line (api, engine-core, tp-rank-N)."""
    log_format = log_format or os.environ.get(FORMAT_ENV, "text")
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, not {log_format!r}")
    os.environ[FORMAT_ENV] = log_format  # processes started from here write the same shape
    os.environ[LEVEL_ENV] = level.upper()
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter(role or "pagoda"))
    else:
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s {role + ' ' if role else ''}%(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
