"""RFC 9421 / RFC 9530 verification and signing: known answers, every refusal, interop."""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import pickle
import random
import time
from typing import Any

import pytest
from http_message_signatures import HTTPMessageSigner, HTTPMessageVerifier, MappingKeyResolver
from http_message_signatures.algorithms import HMAC_SHA256
from http_sfv.dictionary import Dictionary
from http_sfv.item import InnerList

from service.auth import signature as sig
from service.auth.authenticator import signature_headers
from service.auth.signature import (
    COVERED_COMPONENTS,
    AuthError,
    check_content_digest,
    content_digest,
    hmac_sha256,
    parse_signature,
    serialize_signature_params,
    sign_request,
    signature_base,
    verify_request,
)
from service.errors import Unauthenticated

# RFC 9421 Appendix B.1.5 (test-shared-secret) and B.2.5 (Signing a Request Using hmac-sha256).
RFC_SHARED_SECRET = base64.b64decode(
    "uzvJfB4u3N0Jy4T7NZ75MDVcr8zSTInedJtkgcu46YW4XByzNJjxBdtjUkdJPBtbmHhIDi6pcl8jsasjlTMtDQ=="
)
RFC_B25_BASE = (
    b'"date": Tue, 20 Apr 2021 02:07:55 GMT\n'
    b'"@authority": example.com\n'
    b'"content-type": application/json\n'
    b'"@signature-params": ("date" "@authority" "content-type")'
    b';created=1618884473;keyid="test-shared-secret"'
)
RFC_B25_SIGNATURE_INPUT = (
    'sig-b25=("date" "@authority" "content-type");created=1618884473;keyid="test-shared-secret"'
)
RFC_B25_SIGNATURE = "sig-b25=:pxcQw6G3AjtMBQjwo8XzkZf/bws5LelbaMk5rGIGtE8=:"

SECRET = bytes(range(1, 33))  # fixed test secret for our own known answer
NOW = 1_700_000_000


def test_rfc9421_b25_signature_base_and_value() -> None:
    params = serialize_signature_params(
        ("date", "@authority", "content-type"),
        (("created", 1618884473), ("keyid", "test-shared-secret")),
    )
    base = signature_base(
        (
            ("date", "Tue, 20 Apr 2021 02:07:55 GMT"),
            ("@authority", "example.com"),
            ("content-type", "application/json"),
        ),
        params,
    )
    assert base == RFC_B25_BASE
    mac = hmac_sha256(RFC_SHARED_SECRET, base)
    assert f"sig-b25=:{base64.b64encode(mac).decode()}:" == RFC_B25_SIGNATURE
    assert f"sig-b25={params}" == RFC_B25_SIGNATURE_INPUT


def test_content_digest_known_answers() -> None:
    # RFC 9530 section 2 example body, and the empty body every GET carries.
    assert content_digest(b'{"hello": "world"}') == (
        "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:"
    )
    assert content_digest(b"") == "sha-256=:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=:"


def test_cryptd_request_known_answer() -> None:
    headers = sign_request(
        "POST", "/v1/encrypt/orders", "", b'{"plaintext":"aGk="}', "app-1", SECRET, NOW, "n-1"
    )
    expected_params = (
        '("@method" "@path" "@query" "content-digest" "content-type")'
        ';created=1700000000;nonce="n-1";keyid="app-1";alg="hmac-sha256"'
    )
    assert headers["Signature-Input"] == "sig1=" + expected_params
    assert headers["Content-Type"] == "application/json"
    digest = (
        "sha-256=:" + base64.b64encode(hashlib.sha256(b'{"plaintext":"aGk="}').digest()).decode()
    )
    assert headers["Content-Digest"] == digest + ":"
    # The base written out by hand from RFC 9421 section 2.5, MAC'd with the stdlib.
    base = (
        '"@method": POST\n"@path": /v1/encrypt/orders\n"@query": ?\n'
        f'"content-digest": {digest}:\n"content-type": application/json\n'
        f'"@signature-params": {expected_params}'
    ).encode()
    mac = hmac.new(SECRET, base, hashlib.sha256).digest()
    assert headers["Signature"] == f"sig1=:{base64.b64encode(mac).decode()}:"


def test_serializer_matches_http_sfv() -> None:
    cases: list[list[tuple[str, int | str]]] = [
        [("created", 0), ("nonce", 'a"b\\c'), ("keyid", "k"), ("alg", "hmac-sha256")],
        [("created", 999999999999999), ("keyid", "x y~!")],
    ]
    for params in cases:
        node = InnerList(list(COVERED_COMPONENTS))
        for name, value in params:
            node.params[name] = value
        assert serialize_signature_params(COVERED_COMPONENTS, params) == str(node)


# --------------------------------------------------------------------------------------------
# Verification


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def _verify(headers: dict[str, str], **overrides: Any) -> sig.SignatureInput:
    request: dict[str, Any] = {
        "method": "POST",
        "path": "/v1/encrypt/orders",
        "query": "",
        "headers": _lower(headers),
        "body": b"{}",
        "secret_for": {"app-1": SECRET}.get,
        "now": NOW,
        "max_age": 300,
    }
    request.update(overrides)
    return verify_request(**request)


def _signed(**overrides: Any) -> dict[str, str]:
    request: dict[str, Any] = {
        "method": "POST",
        "url_path": "/v1/encrypt/orders",
        "query": "",
        "body": b"{}",
        "client_id": "app-1",
        "secret": SECRET,
        "created": NOW,
        "nonce": "nonce-1",
    }
    request.update(overrides)
    return sign_request(**request)


def _custom(
    components: list[str], params: list[tuple[str, int | str]], **values: str
) -> dict[str, str]:
    """A correctly MAC'd request whose Signature-Input is whatever the test wants."""
    headers = _signed()
    component_values = {
        "@method": "POST",
        "@path": "/v1/encrypt/orders",
        "@query": "?",
        "@authority": "example.com",
        "content-digest": headers["Content-Digest"],
        "content-type": headers["Content-Type"],
        **values,
    }
    serialized = serialize_signature_params(components, params)
    base = signature_base([(c, component_values[c]) for c in components], serialized)
    headers["Signature-Input"] = f"sig1={serialized}"
    headers["Signature"] = f"sig1=:{base64.b64encode(hmac_sha256(SECRET, base)).decode()}:"
    return headers


GOOD_PARAMS: list[tuple[str, int | str]] = [
    ("created", NOW),
    ("nonce", "nonce-1"),
    ("keyid", "app-1"),
    ("alg", "hmac-sha256"),
]


def _reason(call: Any) -> str:
    with pytest.raises(AuthError) as info:
        call()
    assert str(info.value) == Unauthenticated.default_message  # one message for every cause
    return info.value.reason


def test_round_trip_returns_signed_parameters() -> None:
    parsed = _verify(_signed())
    assert (parsed.keyid, parsed.nonce, parsed.created, parsed.label) == (
        "app-1",
        "nonce-1",
        NOW,
        "sig1",
    )
    assert "signature=" not in repr(parsed)


def test_query_and_percent_encoded_path_are_signed_as_sent() -> None:
    headers = _signed(url_path="/v1/encrypt/a%20b", query="x=1&y=%2F")
    assert _verify(headers, path="/v1/encrypt/a%20b", query="x=1&y=%2F").keyid == "app-1"
    assert _reason(lambda: _verify(headers, path="/v1/encrypt/a b", query="x=1&y=%2F")) == (
        "bad_signature"
    )


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("Signature", "missing_signature"),
        ("Signature-Input", "missing_signature"),
        ("Content-Digest", "missing_header"),
        ("Content-Type", "missing_header"),
    ],
)
def test_missing_header(header: str, reason: str) -> None:
    headers = _signed()
    del headers[header]
    assert _reason(lambda: _verify(headers)) == reason


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"method": "PUT"}, "bad_signature"),
        ({"path": "/v1/encrypt/other"}, "bad_signature"),
        ({"query": "x=1"}, "bad_signature"),
        ({"body": b'{"x":1}'}, "bad_digest"),
        ({"secret_for": {"app-1": bytes(32)}.get}, "bad_signature"),
        ({"secret_for": {}.get}, "unknown_client"),
        ({"now": NOW + 301}, "stale"),
        ({"now": NOW - 301}, "future"),
    ],
)
def test_altered_request(change: dict[str, Any], reason: str) -> None:
    assert _reason(lambda: _verify(_signed(), **change)) == reason


def test_age_window_edges_are_inclusive() -> None:
    assert _verify(_signed(), now=NOW + 300).keyid == "app-1"
    assert _verify(_signed(), now=NOW + 10, max_age=10).keyid == "app-1"
    assert _reason(lambda: _verify(_signed(), now=NOW + 11, max_age=10)) == "stale"
    # Ahead of the server's clock: max_skew (5 s by default), not max_age.
    assert _verify(_signed(), now=NOW - 5).keyid == "app-1"
    assert _reason(lambda: _verify(_signed(), now=NOW - 6)) == "future"
    assert _verify(_signed(), now=NOW - 300, max_skew=300).keyid == "app-1"
    assert _reason(lambda: _verify(_signed(), now=NOW - 301, max_skew=300)) == "future"


def test_altered_content_type_and_digest_header() -> None:
    headers = _signed()
    headers["Content-Type"] = "text/plain"
    assert _reason(lambda: _verify(headers)) == "bad_signature"
    headers = _signed()
    headers["Content-Digest"] = content_digest(b'{"x":1}')
    assert _reason(lambda: _verify(headers, body=b'{"x":1}')) == "bad_signature"


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("Signature-Input", "sig1=(((", "malformed"),
        ("Signature-Input", "", "malformed"),
        ("Signature-Input", "sig1=x" * 400, "malformed"),
        ("Signature-Input", 'sig1=("@method");créé=1', "malformed"),
        ("Signature", "sig1=:not base64!:", "malformed"),
        ("Signature", "sig1=:YWJj:", "bad_signature"),  # valid shape, wrong value
        ("Signature", "sig1=abc", "malformed"),  # a token, not a byte sequence
        ("Signature", "sig2=:YWJj:", "malformed"),  # label differs from Signature-Input
        ("Signature", "sig1=:YWJj:, sig2=:YWJj:", "malformed"),
        ("Content-Digest", "sha-256=abc", "malformed"),
        ("Content-Digest", "sha-512=:YWJj:", "malformed"),  # no sha-256 member
        ("Content-Digest", "sha-256=:YWJj:", "malformed"),  # 3 bytes, not 32
        ("Content-Digest", content_digest(b"other"), "bad_signature"),  # signed value changed
    ],
)
def test_malformed_fields(field: str, value: str, reason: str) -> None:
    headers = _signed()
    headers[field] = value
    assert _reason(lambda: _verify(headers)) == reason


def test_two_signatures_are_refused() -> None:
    headers = _signed()
    headers["Signature-Input"] += ", " + headers["Signature-Input"].replace("sig1=", "sig2=")
    headers["Signature"] += ", " + headers["Signature"].replace("sig1=", "sig2=")
    assert _reason(lambda: _verify(headers)) == "malformed"


def _bogus_signature_input() -> str:
    return _signed(nonce="other-nonce", client_id="someone-else")["Signature-Input"]


@pytest.mark.parametrize("field", ["Signature-Input", "Signature"])
@pytest.mark.parametrize("separate_lines", [False, True])
def test_a_repeated_signature_label_is_refused(field: str, separate_lines: bool) -> None:
    """``sig1=<bogus>, sig1=<valid>``: RFC 8941 would keep the last member, which would let a
    second signature (or a bogus one before the valid one) through. Whether the members share
    a line or come as two field lines (combined as the server combines them), refused."""
    headers = _signed()
    bogus = (
        _bogus_signature_input()
        if field == "Signature-Input"
        else "sig1=:" + base64.b64encode(bytes(32)).decode() + ":"
    )
    if separate_lines:
        raw = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
        raw.insert(0, (field.lower().encode(), bogus.encode()))
        combined = signature_headers(raw)
    else:
        headers[field] = f"{bogus}, {headers[field]}"
        combined = _lower(headers)
    assert _reason(lambda: _verify(combined)) == "malformed"


def test_a_repeated_label_in_one_signature_input_is_refused_after_the_valid_one() -> None:
    headers = _signed()
    headers["Signature-Input"] += ", " + headers["Signature-Input"]
    headers["Signature"] += ", " + headers["Signature"]
    assert _reason(lambda: _verify(headers)) == "malformed"


@pytest.mark.parametrize(
    ("components", "params", "reason"),
    [
        (list(COVERED_COMPONENTS[:-1]), GOOD_PARAMS, "bad_components"),
        ([*COVERED_COMPONENTS, "@authority"], GOOD_PARAMS, "bad_components"),
        (["@path", "@method", *COVERED_COMPONENTS[2:]], GOOD_PARAMS, "bad_components"),
        (list(COVERED_COMPONENTS), [p for p in GOOD_PARAMS if p[0] != "alg"], "wrong_alg"),
        (list(COVERED_COMPONENTS), [*GOOD_PARAMS[:3], ("alg", "hmac-sha512")], "wrong_alg"),
        (list(COVERED_COMPONENTS), [p for p in GOOD_PARAMS if p[0] != "nonce"], "bad_params"),
        (list(COVERED_COMPONENTS), [p for p in GOOD_PARAMS if p[0] != "keyid"], "bad_params"),
        (list(COVERED_COMPONENTS), [p for p in GOOD_PARAMS if p[0] != "created"], "bad_params"),
        (list(COVERED_COMPONENTS), [*GOOD_PARAMS, ("expires", NOW + 10)], "bad_params"),
        (list(COVERED_COMPONENTS), [*GOOD_PARAMS, ("tag", "x")], "bad_params"),
        (list(COVERED_COMPONENTS), [("created", "1"), *GOOD_PARAMS[1:]], "bad_params"),
        (
            list(COVERED_COMPONENTS),
            [GOOD_PARAMS[0], ("nonce", "n" * 129), *GOOD_PARAMS[2:]],
            "bad_params",
        ),
        (list(COVERED_COMPONENTS), [GOOD_PARAMS[0], ("nonce", ""), *GOOD_PARAMS[2:]], "bad_params"),
    ],
)
def test_signature_shape_refused_even_with_a_valid_mac(
    components: list[str], params: list[tuple[str, int | str]], reason: str
) -> None:
    assert _reason(lambda: _verify(_custom(components, params))) == reason


def test_component_parameters_and_tokens_are_refused() -> None:
    headers = _signed()
    headers["Signature-Input"] = headers["Signature-Input"].replace(
        '"content-type")', '"content-type";sf)'
    )
    assert _reason(lambda: _verify(headers)) == "bad_components"
    headers = _signed()
    headers["Signature-Input"] = headers["Signature-Input"].replace('nonce="nonce-1"', "nonce=tok")
    assert _reason(lambda: _verify(headers)) == "bad_params"


@pytest.mark.parametrize(
    "spelling",
    [
        # Valid structured-field spellings of the same signature: the general parser takes them.
        lambda s: s.replace("sig1=(", "sig1=(  ").replace('"content-type")', '"content-type" )'),
        lambda s: s.replace('" "', '"   "'),
        lambda s: s.replace(";nonce", ";  nonce"),
        lambda s: s.replace(f"created={NOW}", f"created=000{NOW}"),
    ],
)
def test_equivalent_spellings_verify(spelling: Any) -> None:
    headers = _signed()
    headers["Signature-Input"] = spelling(headers["Signature-Input"])
    assert headers["Signature-Input"] != _signed()["Signature-Input"]
    assert _verify(headers).nonce == "nonce-1"


def test_other_parameter_order_and_escaped_nonce_verify() -> None:
    params: list[tuple[str, int | str]] = [
        ("keyid", "app-1"),
        ("alg", "hmac-sha256"),
        ("nonce", 'q"uo\\te'),
        ("created", NOW),
    ]
    parsed = _verify(_custom(list(COVERED_COMPONENTS), params))
    assert parsed.nonce == 'q"uo\\te'


def _outcome(parse: Any, signature_input: str, signature: str) -> object:
    try:
        return parse(signature_input, signature)
    except AuthError as exc:
        return exc.reason


def _reference(signature_input: str, signature: str) -> sig.SignatureInput:
    return sig._check_params(*sig._reference_parse(signature_input, signature))


def test_fast_path_agrees_with_general_parser() -> None:
    """Whenever the canonical fast path accepts a mutated field, http_sfv reads it the same."""
    rng = random.Random(9421)
    base_input = _signed()["Signature-Input"]
    signature = _signed()["Signature"]
    alphabet = ' ();=",\\:*-_.abcdeflmnorstyz0123456789@'
    accepted = 0
    for _ in range(20000):
        text = list(base_input)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(text))
            action = rng.random()
            if action < 0.4:
                text[pos] = rng.choice(alphabet)
            elif action < 0.7:
                text.insert(pos, rng.choice(alphabet))
            else:
                del text[pos]
        candidate = "".join(text)
        if sig._CANONICAL_INPUT_RE.fullmatch(candidate) is None:
            continue
        accepted += 1
        fast = _outcome(parse_signature, candidate, signature)
        assert fast == _outcome(_reference, candidate, signature), candidate
    assert accepted > 50  # the mutations did exercise the fast path


def test_auth_error_pickles_with_its_reason() -> None:
    error = pickle.loads(pickle.dumps(AuthError("stale")))  # noqa: S301 (our own bytes)
    assert isinstance(error, AuthError)
    assert isinstance(error, Unauthenticated)
    assert error.reason == "stale"


def test_content_digest_sha512_member_is_checked_too() -> None:
    body = b"payload"
    sha512 = base64.b64encode(hashlib.sha512(body).digest()).decode()
    check_content_digest(f"{content_digest(body)}, sha-512=:{sha512}:", body)
    wrong = base64.b64encode(hashlib.sha512(b"other").digest()).decode()
    assert _reason(
        lambda: check_content_digest(f"{content_digest(body)}, sha-512=:{wrong}:", body)
    ) == ("bad_digest")
    # Unknown algorithms are ignored (RFC 9530), wrong lengths are not.
    check_content_digest(f"{content_digest(body)}, md5=:YWJj:", body)
    assert _reason(lambda: check_content_digest("sha-256=:YWJj:", body)) == "malformed"


# --------------------------------------------------------------------------------------------
# Interop with an independent implementation: the http-message-signatures library


class _Message:
    def __init__(self, method: str, url: str, headers: dict[str, str]) -> None:
        self.method, self.url, self.headers = method, url, headers


def _library_verifier() -> HTTPMessageVerifier:
    resolver = MappingKeyResolver(public_keys={"app-1": SECRET}, private_keys={"app-1": SECRET})
    return HTTPMessageVerifier(signature_algorithm=HMAC_SHA256, key_resolver=resolver)


def test_library_verifies_our_signatures() -> None:
    body = b'{"plaintext":"aGk="}'
    headers = sign_request("POST", "/v1/encrypt/orders", "a=1", body, "app-1", SECRET)
    message = _Message("POST", "http://cryptd.internal:8080/v1/encrypt/orders?a=1", headers)
    results = _library_verifier().verify(
        message,
        max_age=datetime.timedelta(seconds=300),
        require_components=COVERED_COMPONENTS,
        body=body,
    )
    assert results[0].parameters["keyid"] == "app-1"
    assert results[0].body == body


def test_we_verify_library_signatures() -> None:
    body = b'{"message":"aGk="}'
    message = _Message(
        "POST", "http://cryptd.internal/v1/sign/doc?x=%2F", {"Content-Type": "application/json"}
    )
    resolver = MappingKeyResolver(public_keys={}, private_keys={"app-1": SECRET})
    HTTPMessageSigner(signature_algorithm=HMAC_SHA256, key_resolver=resolver).sign(
        message,
        key_id="app-1",
        nonce="library-nonce",
        label="sig1",
        covered_component_ids=COVERED_COMPONENTS,
        body=body,
    )
    # The library orders parameters differently (created, keyid, alg, nonce): not canonical.
    assert sig._CANONICAL_INPUT_RE.fullmatch(message.headers["Signature-Input"]) is None
    parsed = _verify(
        message.headers, path="/v1/sign/doc", query="x=%2F", body=body, now=time.time()
    )
    assert parsed.nonce == "library-nonce"


def test_dictionary_spelling_of_rfc_example_parses_with_http_sfv() -> None:
    # Sanity check of the reference parser on the RFC's own field values.
    node = Dictionary()
    node.parse(RFC_B25_SIGNATURE_INPUT.encode())
    assert node["sig-b25"].params["created"] == 1618884473
