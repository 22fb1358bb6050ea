"""RFC 9421 HTTP Message Signatures (``hmac-sha256``) and RFC 9530 ``Content-Digest``.

Pure functions: strings and bytes in, a verified signature or an :class:`AuthError` out; no I/O,
and the verifier has no clock of its own (callers pass ``now``). cryptd signs exactly one shape
of request::

    Content-Digest: sha-256=:<base64 sha256(body)>:
    Signature-Input: sig1=("@method" "@path" "@query" "content-digest" "content-type")
                     ;created=<unix>;nonce="<random>";keyid="<client id>";alg="hmac-sha256"
    Signature: sig1=:<base64 hmac>:

so the verifier refuses every other shape instead of interpreting it: fewer code paths, no
component resolution driven by the attacker. Our own canonical spelling is recognised by one
regular expression (~7 us per verification in all); any other spelling goes through the
general ``http_sfv`` parser. The generic ``http-message-signatures`` verifier measured ~185 us
per request here, most of a 200-500 us request, hence this direct implementation.
"""

from __future__ import annotations

import binascii
import functools
import hashlib
import hmac
import os
import re
from collections.abc import Callable, Mapping
from typing import Final, Literal, NamedTuple

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives import hmac as keyed_hmac
from http_sfv.dictionary import Dictionary
from http_sfv.item import AllItemType, InnerList, Item

# The signer's side (constants, serializer, signature base, digest, sign_request) is the light
# client's, so both ends build the signature base with the same code; the verifier is here.
from cryptd_client.signing import ALGORITHM as ALGORITHM
from cryptd_client.signing import CONTENT_TYPE as CONTENT_TYPE
from cryptd_client.signing import COVERED_COMPONENTS as COVERED_COMPONENTS
from cryptd_client.signing import COVERED_SERIALIZED
from cryptd_client.signing import LABEL as LABEL
from cryptd_client.signing import REQUIRED_PARAMS as REQUIRED_PARAMS
from cryptd_client.signing import content_digest as content_digest
from cryptd_client.signing import hmac_sha256 as hmac_sha256
from cryptd_client.signing import serialize_signature_params as serialize_signature_params
from cryptd_client.signing import sign_request as sign_request
from cryptd_client.signing import signature_base as signature_base
from service.defaults import DEFAULT_MAX_SKEW as DEFAULT_MAX_SKEW
from service.errors import Unauthenticated

DEFAULT_MAX_AGE: Final = 300
MAX_NONCE_LENGTH: Final = 128
# Field values longer than this are refused before parsing: a real one is ~200 bytes.
MAX_FIELD_LENGTH: Final = 2048

# Header names (lower case, as ASGI delivers them) the verifier reads.
SIGNATURE_HEADERS: Final = frozenset(
    {"signature", "signature-input", "content-digest", "content-type"}
)

Reason = Literal[
    "missing_signature",  # no Signature or no Signature-Input field
    "missing_header",  # a covered field (Content-Digest, Content-Type) is absent
    "malformed",  # a field is not the structured value it must be
    "bad_components",  # covered components are not exactly COVERED_COMPONENTS
    "bad_params",  # created/nonce/keyid missing, of the wrong type, or unknown parameters
    "wrong_alg",  # alg missing or not hmac-sha256
    "stale",  # created older than max_age
    "future",  # created more than max_skew ahead
    "unknown_client",  # keyid names no configured client
    "bad_signature",  # the HMAC does not match
    "bad_digest",  # Content-Digest does not match the body
    "replayed",  # (keyid, nonce) already seen (decided by the middleware)
    "certificate_mismatch",  # the client lists certificates; the connection's is not one
    "unknown_certificate",  # no signature, and no certificate-only client for the certificate
]

_DIGESTS: Final[Mapping[str, Callable[[bytes], bytes]]] = {
    "sha-256": lambda data: hashlib.sha256(data).digest(),
    "sha-512": lambda data: hashlib.sha512(data).digest(),
}
_DIGEST_SIZES: Final = {"sha-256": 32, "sha-512": 64}
# Compared against when the client is unknown, so that path costs the same as a wrong secret.
_DUMMY_SECRET: Final = os.urandom(32)


class AuthError(Unauthenticated):
    """The request is not authenticated.

    ``reason`` is for metrics and logs only; the client always sees the one
    :class:`~service.errors.Unauthenticated` message, whatever the cause.
    """

    def __init__(self, reason: Reason) -> None:
        super().__init__()
        self.reason: Reason = reason

    def __reduce__(self) -> tuple[type[AuthError], tuple[Reason]]:
        return (type(self), (self.reason,))


class SignatureInput(NamedTuple):
    """One parsed signature: its signed parameters and the signature bytes. (A named tuple:
    immutable, and a tenth of a frozen dataclass's cost to build on every request.)"""

    label: str
    keyid: str
    nonce: str
    created: int
    signature_params: str  # serialized inner list: the "@signature-params" value
    signature: bytes

    def __repr__(self) -> str:
        return (
            f"SignatureInput(label={self.label!r}, keyid={self.keyid!r}, nonce={self.nonce!r}, "
            f"created={self.created!r}, signature_params={self.signature_params!r})"
        )


# --------------------------------------------------------------------------------------------
# Building blocks (also used by the known-answer tests)


def parse_content_digest(value: str) -> dict[str, bytes]:
    """The digests of a ``Content-Digest`` field by algorithm (sha-256 required, sha-512
    optional; members for other algorithms are ignored, RFC 9530 section 2)."""
    match = _DIGEST_RE.fullmatch(value)
    digests = {"sha-256": _b64decode(match.group(1))} if match else _parse_digest_dictionary(value)
    for algorithm, expected in digests.items():
        if len(expected) != _DIGEST_SIZES[algorithm]:
            raise AuthError("malformed")
    return digests


def check_content_digest(value: str | dict[str, bytes], body: bytes) -> None:
    """Check a ``Content-Digest`` field (or its parsed digests) against ``body``."""
    digests = parse_content_digest(value) if isinstance(value, str) else value
    for algorithm, expected in digests.items():
        if not hmac.compare_digest(expected, _DIGESTS[algorithm](body)):
            raise AuthError("bad_digest")


def parse_signature(signature_input: str, signature: str) -> SignatureInput:
    """Parse and check the ``Signature-Input`` and ``Signature`` fields of one request.

    Requests from cryptd signers take a fast path: one regular expression that matches only
    the canonical serialization of a valid signature (so the matched text is the
    ``@signature-params`` value as is). Anything else goes through the general ``http_sfv``
    parser, which either accepts it (another valid spelling, e.g. other parameter order) or
    says precisely what is wrong.
    """
    if len(signature_input) > MAX_FIELD_LENGTH or len(signature) > MAX_FIELD_LENGTH:
        raise AuthError("malformed")
    canonical = _CANONICAL_INPUT_RE.fullmatch(signature_input)
    sig = _SIGNATURE_RE.fullmatch(signature)
    if canonical is not None and sig is not None and canonical.group(1) == sig.group(1):
        label, params, created, nonce, keyid = canonical.groups()
        return SignatureInput(
            label=label,
            keyid=keyid,
            nonce=nonce,
            created=int(created),
            signature_params=params,
            signature=_b64decode(sig.group(2)),
        )
    return _check_params(*_reference_parse(signature_input, signature))


# The canonical serialization our signer writes: sf-strings without escapes, integers without
# leading zeros, parameters in REQUIRED_PARAMS order (RFC 8941 sections 3 and 4).
_KEY = r"[a-z*][a-z0-9_\-.*]*"
_PLAIN = r"[ !#-\[\]-~]"  # printable ASCII except '"' and '\'
_CANONICAL_INPUT_RE = re.compile(
    rf"({_KEY})=({re.escape(COVERED_SERIALIZED)};created=(0|[1-9][0-9]{{0,14}})"
    rf';nonce="({_PLAIN}{{1,{MAX_NONCE_LENGTH}}})";keyid="({_PLAIN}+)";alg="{ALGORITHM}")'
)
_SIGNATURE_RE = re.compile(rf"({_KEY})=:([A-Za-z0-9+/]*={{0,2}}):")
_DIGEST_RE = re.compile(r"sha-256=:([A-Za-z0-9+/]*={0,2}):")

_Params = list[tuple[str, object]]


class _UniqueKeyDictionary(Dictionary):
    """A structured-field dictionary that refuses a repeated member name. RFC 8941 lets the
    last one win, so ``sig1=<bogus>, sig1=<valid>`` (two field lines combined, or one line)
    would otherwise read as a single signature: we refuse more than one instead."""

    def __setitem__(self, key: str, value: AllItemType) -> None:
        if key in self.data:
            raise ValueError("repeated dictionary member")
        super().__setitem__(key, value)


def _reference_parse(signature_input: str, signature: str) -> tuple[str, _Params, bytes]:
    inputs = _parse_dictionary(signature_input, unique=True)
    signatures = _parse_dictionary(signature, unique=True)
    # One signature per request: a second one would be a second policy to get right.
    if len(inputs) != 1 or list(inputs) != list(signatures):
        raise AuthError("malformed")
    label = next(iter(inputs))
    members, sig_item = inputs[label], signatures[label]
    if not isinstance(members, InnerList) or not isinstance(sig_item, Item):
        raise AuthError("malformed")
    if not isinstance(sig_item.value, bytes) or sig_item.params:
        raise AuthError("malformed")
    # Components must be plain strings without parameters, exactly ours, in our order.
    if len(members) != len(COVERED_COMPONENTS) or any(
        type(item.value) is not str or item.params or item.value != expected
        for item, expected in zip(members, COVERED_COMPONENTS, strict=False)
    ):
        raise AuthError("bad_components")
    return label, list(members.params.items()), sig_item.value


def _check_params(label: str, params: _Params, mac: bytes) -> SignatureInput:
    values = dict(params)
    alg = values.get("alg")
    if type(alg) is not str or alg != ALGORITHM:
        raise AuthError("wrong_alg")
    created, nonce, keyid = values.get("created"), values.get("nonce"), values.get("keyid")
    if (
        values.keys() != set(REQUIRED_PARAMS)
        or type(created) is not int
        or type(nonce) is not str
        or type(keyid) is not str
    ):
        raise AuthError("bad_params")
    if not 0 < len(nonce) <= MAX_NONCE_LENGTH or not keyid:
        raise AuthError("bad_params")
    typed: dict[str, int | str] = {"created": created, "nonce": nonce, "keyid": keyid, "alg": alg}
    try:
        # Re-serialized from the parsed values, as RFC 9421 section 3.2 has the verifier do.
        signature_params = serialize_signature_params(
            COVERED_COMPONENTS, [(name, typed[name]) for name, _ in params]
        )
    except ValueError:
        raise AuthError("malformed") from None
    return SignatureInput(
        label=label,
        keyid=keyid,
        nonce=nonce,
        created=created,
        signature_params=signature_params,
        signature=mac,
    )


@functools.lru_cache(maxsize=256)
def _keyed(secret: bytes) -> keyed_hmac.HMAC:
    """HMAC-SHA256 already keyed with ``secret``, to copy for each request: the key schedule
    and OpenSSL's algorithm lookup are paid once per client, not per request (~2 us less a
    verification). Bounded: a client file holds a few secrets, rotations add a few more."""
    return keyed_hmac.HMAC(secret, hashes.SHA256())


def _b64decode(text: str) -> bytes:
    # base64.b64decode(text, validate=True) without its Python wrapper: the same strict codec.
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        raise AuthError("malformed") from None


def _parse_dictionary(value: str, *, unique: bool = False) -> Dictionary:
    if len(value) > MAX_FIELD_LENGTH:
        raise AuthError("malformed")
    node = _UniqueKeyDictionary() if unique else Dictionary()
    try:
        node.parse(value.encode("ascii"))
    except (ValueError, UnicodeEncodeError):
        raise AuthError("malformed") from None
    return node


def _parse_digest_dictionary(value: str) -> dict[str, bytes]:
    members = _parse_dictionary(value)
    if "sha-256" not in members:
        raise AuthError("malformed")
    digests: dict[str, bytes] = {}
    for algorithm, member in members.items():
        if algorithm not in _DIGESTS:
            continue
        if not isinstance(member, Item) or not isinstance(member.value, bytes):
            raise AuthError("malformed")
        digests[algorithm] = member.value
    return digests


# --------------------------------------------------------------------------------------------
# Verification and signing


def verify_request(
    *,
    method: str,
    path: str,
    query: str,
    headers: Mapping[str, str],
    body: bytes,
    secret_for: Callable[[str], bytes | None],
    now: float,
    max_age: int = DEFAULT_MAX_AGE,
    max_skew: int = DEFAULT_MAX_SKEW,
) -> SignatureInput:
    """Verify one request; return its signature parameters or raise :class:`AuthError`.

    ``path`` is the request path as sent (still percent-encoded), ``query`` the query string
    without ``?`` (empty when none), ``headers`` maps lower-case names to combined values.
    ``secret_for(keyid)`` returns the client's HMAC key, or None for an unknown client.
    ``created`` may be up to ``max_age`` seconds behind ``now`` and ``max_skew`` ahead.
    Nothing here remembers nonces: replay is the caller's job, after this returns.
    """
    sig_input_field = headers.get("signature-input")
    sig_field = headers.get("signature")
    if sig_input_field is None or sig_field is None:
        raise AuthError("missing_signature")
    digest_field = headers.get("content-digest")
    content_type = headers.get("content-type")
    if digest_field is None or content_type is None:
        raise AuthError("missing_header")

    parsed = parse_signature(sig_input_field, sig_field)
    # The usual field, one sha-256 member, is matched here; anything else is parsed in full.
    canonical_digest = _DIGEST_RE.fullmatch(digest_field)
    if canonical_digest is not None:
        sha256 = _b64decode(canonical_digest.group(1))
        if len(sha256) != _DIGEST_SIZES["sha-256"]:
            raise AuthError("malformed")
        digests = None
    else:
        digests = parse_content_digest(digest_field)
    if parsed.created < now - max_age:
        raise AuthError("stale")
    if parsed.created > now + max_skew:
        raise AuthError("future")

    # RFC 9421 section 2.5, for exactly COVERED_COMPONENTS (what signature_base builds).
    text = (
        f'"@method": {method}\n"@path": {path or "/"}\n"@query": ?{query}\n'
        f'"content-digest": {digest_field}\n"content-type": {content_type}\n'
        f'"@signature-params": {parsed.signature_params}'
    )
    if "\r" in text or text.count("\n") != len(COVERED_COMPONENTS):
        raise AuthError("malformed")
    try:
        base = text.encode("ascii")
    except UnicodeEncodeError:
        raise AuthError("malformed") from None
    secret = secret_for(parsed.keyid)
    mac = _keyed(_DUMMY_SECRET if secret is None else secret).copy()
    mac.update(base)
    expected = mac.finalize()
    if not hmac.compare_digest(expected, parsed.signature) or secret is None:
        raise AuthError("unknown_client" if secret is None else "bad_signature")
    # The digest field is authentic now; the body must match it.
    if digests is None:
        if not hmac.compare_digest(sha256, hashlib.sha256(body).digest()):
            raise AuthError("bad_digest")
    else:
        check_content_digest(digests, body)
    return parsed
