"""Structured JSON logs on stderr, one access line per request, and the audit stream.

Every line is one JSON object (orjson). Lines go through a queue to a writer thread, one per
destination, so a slow or blocked stderr pipe or disk never stalls the event loop. Access and
audit lines are queued as tuples of fields and serialized by the writer thread in batches: the
request path pays a tuple and a deque append.

What is never logged: request or response bodies, key material, secrets, signatures, exception
messages (library messages can quote their input: a validation error repeats the field it
refused) and ``bytes`` values of any kind. Log calls carry identifiers and outcomes only.

One module per job: :mod:`~service.logs.writer` (the background writer),
:mod:`~service.logs.fields` (times and plain values), :mod:`~service.logs.handler` (log
records), :mod:`~service.logs.access`, :mod:`~service.logs.audit`, and
:mod:`~service.logs.setup` (:func:`configure_logging`).
"""

from service.logs.access import AccessLog as AccessLog
from service.logs.audit import Audit as Audit
from service.logs.handler import JsonHandler as JsonHandler
from service.logs.setup import LEVELS as LEVELS
from service.logs.setup import LogSetup as LogSetup
from service.logs.setup import configure_logging as configure_logging
from service.logs.writer import LineWriter as LineWriter
