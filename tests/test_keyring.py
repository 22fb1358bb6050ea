"""Keyring behaviour that needs no server: activation delay of new versions, name rules."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.errors import InvalidRequest
from service.keys.keyring import check_key_name
from service.keys.manager import KeyManager, create_keyring_file
from service.keys.masterkey import MasterKey


def manager(tmp_path: Path, delay: float) -> KeyManager:
    master = MasterKey(os.urandom(32))
    path = tmp_path / "keyring.json"
    if not path.exists():
        create_keyring_file(path, master)
        writer = KeyManager(path, master)
        writer.load()
        writer.create("k", "aes256-gcm")
        writer.rotate("k")
    reader = KeyManager(path, master, activation_delay=delay)
    reader.load()
    return reader


def test_new_version_waits_for_the_activation_delay(tmp_path: Path) -> None:
    key = manager(tmp_path, delay=120).keyring.key("k")
    created = key.versions[2].created_ts
    assert key.latest_version == 2
    assert key.active_version(now=created + 10) == 1  # replicas may not have v2 yet
    assert key.active_version(now=created + 121) == 2
    assert key.version(None).version == 1
    assert key.version(2).version == 2  # decryption and explicit requests take any version


def test_without_delay_the_latest_version_is_active(tmp_path: Path) -> None:
    key = manager(tmp_path, delay=0).keyring.key("k")
    assert key.active_version() == 2


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a b", "é", "x" * 129, "a\x00"])
def test_invalid_key_names(name: str) -> None:
    with pytest.raises(InvalidRequest):
        check_key_name(name)


@pytest.mark.parametrize("name", ["a", "A-b_c.d", "x" * 128, "..."])
def test_valid_key_names(name: str) -> None:
    assert check_key_name(name) == name
