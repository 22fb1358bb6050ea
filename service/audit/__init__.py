"""The audit trail: one durable, hash-chained record per API request, signed checkpoints.

One module per job: :mod:`~service.audit.chain` (the record format and the hash chain),
:mod:`~service.audit.checkpoint` (what a checkpoint signs), :mod:`~service.audit.redact`
(HMAC of sensitive values), :mod:`~service.audit.writer` (the file, group commit, rotation),
:mod:`~service.audit.syslog` (the optional second sink) and :mod:`~service.audit.verify`
(``cryptd audit verify``). Nothing here knows keys or HTTP: the signer and the HMAC key are
handed in.
"""
