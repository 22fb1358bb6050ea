"""What one keyring refresh costs a worker, part by part, on a real PostgreSQL key store.

    python -m loadtest.refresh_cost [--keys 300 3000] [--repeat 7] [--url URL]

For each size: a database of its own holding ``--keys`` AES-256-GCM keys of two versions each
(the fault campaign's keyring is of this kind), one manager that changes one key's state and
one that reads. Timed (median of ``--repeat``, milliseconds): the parts of a full read (the SQL
read of every row, the canonical serialisation, the HMAC, the parse, building the keyring from
the previous one) and the whole ``refresh(force=True)`` after a one-key change; and where the
store offers it, the ``refresh()`` a notification naming the changed key starts. Figures are
upper bounds on a shared machine: the load average is printed with them.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from loadtest.keystore import DEFAULT_URL, as_url, scratch_database
from service.crypto.registry import KEY_TYPES
from service.keys.admin import initialise
from service.keys.document import KeyRecord, KeyringDocument, canonical, utc_now
from service.keys.integrity import Verified, build_keyring, digest_of
from service.keys.manager import KeyManager
from service.keys.masterkey import MasterKey
from service.keys.pgstore import PostgresKeyStore
from service.keys.records import wrap_version
from service.keys.store import Changed


def populate(manager: KeyManager, keys: int) -> None:
    """``keys`` keys of two versions each, committed as one change."""
    master = manager.master
    aes = KEY_TYPES["aes256-gcm"]

    def change(document: KeyringDocument) -> None:
        for n in range(keys):
            name = f"campaign-{n:05d}"
            versions = [wrap_version(master, name, "aes256-gcm", v, aes.generate()) for v in (1, 2)]
            document.keys[name] = KeyRecord("aes256-gcm", utc_now(), versions)

    manager.snapshot.apply(change)


def median_ms(run: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2)


def measure(url: str, keys: int, repeat: int) -> dict[str, Any]:
    master = MasterKey(os.urandom(32))
    with scratch_database(url) as conninfo:
        db = as_url(conninfo)
        writer_store, reader_store = PostgresKeyStore(db), PostgresKeyStore(db)
        try:
            initialise(writer_store, master)
            writer = KeyManager(writer_store, master)
            writer.load()
            populate(writer, keys)
            reader = KeyManager(reader_store, master)
            reader.load()
            raw = reader_store.read()
            assert raw is not None
            content = canonical(raw)
            tag = base64.b64decode(raw["mac"])
            document = KeyringDocument.parse(raw)
            verified = Verified(document, digest_of(content))
            previous = reader.keyring
            parts = {
                "sql_read": median_ms(reader_store.read, repeat),
                "canonical": median_ms(lambda: canonical(raw), repeat),
                "hmac": median_ms(lambda: master.verify_mac(content, tag), repeat),
                "parse": median_ms(lambda: KeyringDocument.parse(raw), repeat),
                "build_keyring_reusing": median_ms(
                    lambda: build_keyring(verified, master, previous), repeat
                ),
                "document_bytes": len(content),
            }
            states = ["disabled", "enabled"]

            def full() -> None:
                writer.update("campaign-00007", state=states[0])
                states.reverse()
                started = time.perf_counter()
                assert reader.refresh(force=True)
                full_times.append((time.perf_counter() - started) * 1000)

            full_times: list[float] = []
            for _ in range(repeat):
                full()
            parts["refresh_force_after_one_change"] = round(statistics.median(full_times), 2)
            hint = getattr(reader.snapshot, "heard", None)
            if hint is not None:
                inc_times: list[float] = []
                for _ in range(repeat):
                    writer.update("campaign-00007", state=states[0])
                    states.reverse()
                    generation = writer.keyring.generation
                    hint(Changed(generation, frozenset({"campaign-00007"})))
                    started = time.perf_counter()
                    assert reader.refresh()
                    inc_times.append((time.perf_counter() - started) * 1000)
                parts["refresh_on_notice_naming_the_key"] = round(statistics.median(inc_times), 2)
            return parts
        finally:
            writer_store.close()
            reader_store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[300, 3000])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--url", default=DEFAULT_URL)
    args = parser.parse_args()
    for keys in args.keys:
        figures = measure(args.url, keys, args.repeat)
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"{keys} keys / {2 * keys} versions (load average {load}): {figures}")


if __name__ == "__main__":
    main()
