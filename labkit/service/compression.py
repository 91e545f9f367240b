"""Compression in the app (``HttpConfig.gzip``): Starlette's ``GZipMiddleware``, and what it does to a stream.

What the installed middleware does (starlette 1.10, ``starlette/middleware/gzip.py``, read from
site-packages):

* It compresses only when the request's ``Accept-Encoding`` contains ``gzip``.
* It excludes ``text/event-stream`` by default: the type is in ``DEFAULT_EXCLUDED_CONTENT_TYPES``,
  matched against the response's ``Content-Type`` up to its ``;`` (so ours, with
  ``; charset=utf-8``, matches). An excluded response passes through untouched: no
  ``Content-Encoding``, no ``Vary``, each body message sent as it comes. So ``gzip=default``
  compresses the JSON answers (``/v1/generate``, ``/stats``, refusals) and leaves every stream
  alone.
* When a stream is not excluded (``gzip=events`` removes ``text/event-stream`` from the list), it
  does not hold events back: each body message is compressed and then flushed with
  ``Z_SYNC_FLUSH``, so every event still leaves as its own chunk, a few bytes of deflate framing
  heavier (the flush marker) and small events barely shrink. The 500-byte ``minimum_size``
  applies only to single-message answers; a stream is compressed whatever its size. Chunks of
  128 KiB or more are compressed in a worker thread (its own limiter of 40, not AnyIO's).

So in this app gzip cannot cause the "everything arrives at the end" burst that a proxy's gzip
buffer does; ``gzip=events`` is there so a notebook can measure what compressing each event costs.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.middleware.gzip import DEFAULT_EXCLUDED_CONTENT_TYPES, GZipMiddleware

SSE_TYPE = "text/event-stream"


def add_gzip(app: FastAPI, mode: str) -> None:
    """Put GZipMiddleware in front of ``app``: ``off`` (nothing), ``default`` or ``events``."""
    if mode == "off":
        return
    if mode not in ("default", "events"):
        raise ValueError(f"gzip must be off, default or events, got {mode!r}")
    excluded: tuple[str, ...] = DEFAULT_EXCLUDED_CONTENT_TYPES
    if mode == "events":
        excluded = tuple(t for t in excluded if t != SSE_TYPE)
    app.add_middleware(GZipMiddleware, exclude_content_types=excluded)
