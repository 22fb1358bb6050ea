"""service.b64 against RFC 4648's test vectors and the standard library, valid and invalid
inputs alike: the SIMD codec accepts nothing the standard library refuses, decodes alike, and
refuses beyond it only padding past a whole quantum ("Zm9v=")."""

from __future__ import annotations

import base64
import binascii
import random

import pytest

from service import b64

# RFC 4648 section 10.
VECTORS = [
    (b"", ""),
    (b"f", "Zg=="),
    (b"fo", "Zm8="),
    (b"foo", "Zm9v"),
    (b"foob", "Zm9vYg=="),
    (b"fooba", "Zm9vYmE="),
    (b"foobar", "Zm9vYmFy"),
]


@pytest.mark.parametrize(("data", "text"), VECTORS)
def test_rfc4648_vectors(data: bytes, text: str) -> None:
    assert b64.encode(data) == text
    assert b64.decode(text) == data
    assert b64.encode_url(data) == text.rstrip("=")
    assert b64.decode_url(text.rstrip("=")) == data
    assert b64.decode_url(text) == data  # padding optional


def _stdlib_decode(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _ours(text: str) -> bytes | None:
    try:
        return b64.decode(text)
    except ValueError:
        return None


def test_agrees_with_the_standard_library_on_random_and_damaged_input() -> None:
    rng = random.Random(20261130)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_ \n.é"
    for size in [*range(0, 70), 1024, 1025, 1026, 4096]:
        data = rng.randbytes(size)
        text = base64.b64encode(data).decode()
        assert b64.encode(data) == text
        assert b64.decode(text) == data
        url = base64.urlsafe_b64encode(data).rstrip(b"=").decode()
        assert b64.encode_url(data) == url
        assert b64.decode_url(url) == data
        for _ in range(20):  # one character replaced, inserted or removed
            position = rng.randrange(len(text) + 1)
            damaged = rng.choice(
                [
                    text[:position] + rng.choice(alphabet) + text[position + 1 :],
                    text[:position] + rng.choice(alphabet) + text[position:],
                    text[:position] + text[position + 1 :],
                ]
            )
            ours, stdlib = _ours(damaged), _stdlib_decode(damaged)
            if ours is not None:  # never accepts what the standard library refuses
                assert ours == stdlib, repr(damaged)
            elif stdlib is not None:  # stricter only on spellings that are not canonical,
                assert base64.b64encode(stdlib).decode() != damaged  # e.g. "Zm9v="


@pytest.mark.parametrize(
    "text", ["Zg", "Zg=", "Zg===", "=Zg=", "Zg==Zg==", "Z g==", "Zg==\n", "Zm9v\n", "-_8=", "é"]
)
def test_strict_decode_refuses(text: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - binascii.Error or ValueError, both refusals
        b64.decode(text)
    assert _stdlib_decode(text) is None


def test_padding_past_a_whole_quantum_is_refused() -> None:
    assert _stdlib_decode("Zm9v=") == b"foo"  # the standard library lets it through
    with pytest.raises(ValueError):  # noqa: PT011
        b64.decode("Zm9v=")


@pytest.mark.parametrize("text", ["+/8", "Zm9v+", "Zm 9v", "Zm9v=x", "é"])
def test_url_decode_refuses_other_alphabets(text: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        b64.decode_url(text)


def _canonical_reference(text: str) -> bytes | None:
    """The standard library's reading, kept only when encoding it again gives ``text``."""
    if not text.isascii() or not text.replace("-", "").replace("_", "").isalnum():
        return None
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except binascii.Error:
        return None
    return data if base64.urlsafe_b64encode(data).rstrip(b"=").decode() == text else None


def test_canonical_url_decode_agrees_with_decoding_and_encoding_again() -> None:
    rng = random.Random(20261201)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_+/= \n.é"
    for size in [*range(0, 40), 1054]:
        url = base64.urlsafe_b64encode(rng.randbytes(size)).rstrip(b"=").decode()
        assert b64.decode_url_canonical(url) == base64.urlsafe_b64decode(url + "==")
        for _ in range(30):  # the last character changed (its unused bits), or any other
            position = rng.choice([len(url) - 1, rng.randrange(len(url) + 1)])
            damaged = url[:position] + rng.choice(alphabet) + url[position + 1 :]
            expected = _canonical_reference(damaged)
            if expected is None:
                with pytest.raises(ValueError):  # noqa: PT011
                    b64.decode_url_canonical(damaged)
            else:
                assert b64.decode_url_canonical(damaged) == expected, repr(damaged)


@pytest.mark.parametrize("text", ["AQ==", "AQ=", "AR", "AQF", "AQEBA", "+/8", "Zm9v=", "é", "A Q"])
def test_canonical_url_decode_refuses(text: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011
        b64.decode_url_canonical(text)
