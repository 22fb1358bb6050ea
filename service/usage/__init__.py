"""Key usage: how often each key version was used, by operation, and when it was last used.

Usage is informational and changes with every request, so it is kept apart from the keyring
document: it is not under the document MAC, a failure to record it never refuses an operation,
and it is never a store write per request. Each server process counts in memory
(:mod:`service.usage.recorder`: one dictionary increment per operation) and adds its counts to
the shared usage store every ``CRYPTD_USAGE_FLUSH_INTERVAL`` seconds and at shutdown, one
transaction of increments per flush (:mod:`service.usage.store`: the interface; one backend
per key store).
"""
