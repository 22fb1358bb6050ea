"""Batch limits by key type (service/batchcost.py): a batch that cannot finish within the pool
deadline is refused up front with 413 naming the limit, before any item runs."""

from __future__ import annotations

import base64
import time

import pydantic
import pytest

from service.batchcost import BUDGET_SHARE, ITEM_COST_US, BatchLimits
from service.config import Settings
from service.crypto.registry import KEY_TYPES
from service.errors import PayloadTooLarge
from tests.conftest import Server


def test_limits_derive_from_the_cost_table_and_the_deadline() -> None:
    limits = BatchLimits(1000, 5.0)
    # 5 ms an RSA-4096 private operation, half of 5 s on one core: 500 items.
    assert limits.limit("rsa-4096", "decrypt") == 500
    assert limits.limit("rsa-4096", "sign") == 500
    assert limits.limit("rsa-4096", "encrypt") == 1000  # public: capped by max_items
    assert limits.limit("aes256-gcm", "decrypt") == 1000  # not in the table
    assert BatchLimits(1000, 1.0).limit("rsa-4096", "decrypt") == 100
    assert BatchLimits(1000, 0.001).limit("rsa-4096", "decrypt") == 1  # never below one
    assert BatchLimits(50, 5.0).limit("rsa-4096", "decrypt") == 50
    for type_name, costs in ITEM_COST_US.items():
        key_type = KEY_TYPES[type_name]
        for op, cost in costs.items():
            assert op in ("rewrap", "datakey") or key_type.supports(op), (type_name, op)  # type: ignore[arg-type]
            assert limits.limit(type_name, op) == min(1000, int(5.0 * BUDGET_SHARE * 1e6 // cost))


def test_a_configured_limit_replaces_the_derived_one() -> None:
    limits = BatchLimits(1000, 5.0, {"rsa-4096": 800, "aes256-gcm": 20, "sm2": 5000})
    assert limits.limit("rsa-4096", "decrypt") == 800
    assert limits.limit("aes256-gcm", "encrypt") == 20
    assert limits.limit("sm2", "sign") == 1000  # never above CRYPTD_MAX_BATCH_ITEMS
    assert limits.limit("rsa-2048", "sign") == 1000


def test_over_the_limit_is_413_naming_it() -> None:
    limits = BatchLimits(1000, 5.0)
    limits.check("rsa-4096", "decrypt", 500)
    with pytest.raises(PayloadTooLarge, match=r"rsa-4096 decrypt batch holds at most 500 items"):
        limits.check("rsa-4096", "decrypt", 501)


def test_the_setting_names_known_key_types(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRYPTD_MAX_BATCH_ITEMS_BY_TYPE", '{"rsa-4096": 64}')
    assert Settings(env="development").max_batch_items_by_type == {"rsa-4096": 64}
    for bad in ('{"rsa-9999": 64}', '{"rsa-4096": 0}', '{"rsa-4096": "many"}'):
        monkeypatch.setenv("CRYPTD_MAX_BATCH_ITEMS_BY_TYPE", bad)
        with pytest.raises(pydantic.ValidationError):
            Settings(env="development")


@pytest.mark.slow  # the shared live server
def test_an_rsa_4096_batch_that_cannot_finish_is_refused_at_once(server: Server) -> None:
    plaintext = base64.b64encode(b"batch").decode()
    sealed = server.request("POST", "/v1/encrypt/rsa-4096", {"plaintext": plaintext})
    assert sealed.status_code == 200, sealed.text
    item = {"ciphertext": sealed.json()["ciphertext"]}
    started = time.monotonic()
    refused = server.request("POST", "/v1/decrypt/rsa-4096", {"batch": [item] * 1000})
    elapsed = time.monotonic() - started
    assert refused.status_code == 413, refused.text[:200]
    assert refused.json()["error"] == {
        "code": "payload_too_large",
        "message": "a rsa-4096 decrypt batch holds at most 500 items (1000 sent): "
        "split it into smaller batches",
    }
    assert elapsed < 2.0  # refused before any RSA work (1,000 decrypts take seconds)
    served = server.request("POST", "/v1/decrypt/rsa-4096", {"batch": [item] * 3})
    assert served.status_code == 200, served.text
    assert [entry["plaintext"] for entry in served.json()["batch"]] == [plaintext] * 3
