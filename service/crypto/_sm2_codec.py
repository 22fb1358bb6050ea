"""SM2 encodings: ciphertext layouts, signature layouts and the curve constants they check against.

Encoding only — no curve arithmetic and no cipher here; libcrypto does the cryptography.

Ciphertext (GB/T 32918.4): C1 = (x1, y1) the ephemeral point, C3 = SM3(x2 || M || y2), C2 = M xor
KDF. Layouts in use:

- C1C3C2, "raw": ``[04] || x1 || y1 || C3 || C2`` (GB/T 32918.4-2016; OpenSSL is DER-only);
- C1C2C3: ``[04] || x1 || y1 || C2 || C3`` (OSCCA's 2010 publication, still the default of
  gmssl and BouncyCastle's SM2Engine);
- GM/T 0009 DER: ``SEQUENCE { INTEGER x1, INTEGER y1, OCTET STRING C3, OCTET STRING C2 }``
  (what OpenSSL emits and consumes).

Every parser is strict and returns ``None`` instead of raising: callers turn any failure into one
opaque error.
"""

from __future__ import annotations

from typing import NamedTuple

# Recommended SM2 curve, GB/T 32918.5-2017 (GM/T 0003.5-2012) section 3.
P = 0xFFFFFFFEFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF00000000FFFFFFFFFFFFFFFF
A = 0xFFFFFFFEFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF00000000FFFFFFFFFFFFFFFC
B = 0x28E9FA9E9D9F5E344D5A9E4BCF6509A7F39789F515AB8F92DDBCBD414D940E93
N = 0xFFFFFFFEFFFFFFFFFFFFFFFFFFFFFFFF7203DF6B21C6052B53BBF40939D54123
GX = 0x32C4AE2C1F1981195F9904466A39C9948FE30BBFF2660BE1715A4589334C74C7
GY = 0xBC3736A2F4F6779C59BDCEE36B692153D0A9877CC62A474002DF32E52139F0A0

SIZE = 32  # bytes in a coordinate, a scalar and an SM3 digest
POINT_PREFIX = b"\x04"  # SEC 1 uncompressed point
SM2_CURVE_OID = bytes.fromhex("06082a811ccf5501822d")  # 1.2.156.10197.1.301, DER encoded
_C1 = 2 * SIZE
_MIN_RAW = _C1 + SIZE + 1  # C1, C3 and at least one byte of C2

_SEQUENCE, _INTEGER, _OCTET_STRING = 0x30, 0x02, 0x04
_MAX_LENGTH_OCTETS = 4  # 4 GiB is far beyond any request the service accepts


class Sm2Ciphertext(NamedTuple):
    x: bytes  # 32 bytes, < p
    y: bytes  # 32 bytes, < p
    c3: bytes  # 32 bytes
    c2: bytes  # >= 1 byte

    def to_c1c3c2(self, *, prefix: bool = True) -> bytes:
        return (POINT_PREFIX if prefix else b"") + self.x + self.y + self.c3 + self.c2

    def to_c1c2c3(self, *, prefix: bool = True) -> bytes:
        return (POINT_PREFIX if prefix else b"") + self.x + self.y + self.c2 + self.c3

    def to_der(self) -> bytes:
        return tlv(
            _SEQUENCE,
            der_integer(int.from_bytes(self.x, "big"))
            + der_integer(int.from_bytes(self.y, "big"))
            + tlv(_OCTET_STRING, self.c3)
            + tlv(_OCTET_STRING, self.c2),
        )


# --- DER primitives ---------------------------------------------------------------------------


def _der_length(length: int) -> bytes:
    if length < 0x80:
        return bytes([length])
    octets = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(octets)]) + octets


def tlv(tag: int, content: bytes) -> bytes:
    return bytes([tag]) + _der_length(len(content)) + content


def der_integer(value: int) -> bytes:
    """Minimal DER INTEGER of a non-negative value (a 0x00 pad when the top bit is set)."""
    return tlv(_INTEGER, value.to_bytes(value.bit_length() // 8 + 1, "big"))


def read_tlv(data: bytes, pos: int, tag: int) -> tuple[bytes, int] | None:
    """Content of the DER element of ``tag`` at ``pos`` and the position after it.

    Definite, minimally encoded lengths only (DER, not BER)."""
    if pos + 2 > len(data) or data[pos] != tag:
        return None
    first = data[pos + 1]
    pos += 2
    if first < 0x80:
        length = first
    else:
        count = first & 0x7F
        if count == 0 or count > _MAX_LENGTH_OCTETS or pos + count > len(data):
            return None  # indefinite length, or absurd
        octets = data[pos : pos + count]
        length = int.from_bytes(octets, "big")
        if octets[0] == 0 or length < 0x80:
            return None  # non-minimal length
        pos += count
    end = pos + length
    if end > len(data):
        return None
    return data[pos:end], end


def _read_unsigned(content: bytes, bound: int) -> int | None:
    """A minimally encoded, non-negative INTEGER below ``bound``."""
    if not content or content[0] & 0x80:
        return None
    if len(content) > 1 and content[0] == 0 and not content[1] & 0x80:
        return None
    value = int.from_bytes(content, "big")
    return value if value < bound else None


# --- ciphertext -------------------------------------------------------------------------------


def _coordinates(x: bytes, y: bytes) -> bool:
    return int.from_bytes(x, "big") < P and int.from_bytes(y, "big") < P


def parse_der(data: bytes) -> Sm2Ciphertext | None:
    """Strict GM/T 0009 DER; the SEQUENCE must span the whole input."""
    outer = read_tlv(data, 0, _SEQUENCE)
    if outer is None or outer[1] != len(data):
        return None
    body = outer[0]
    fields: list[bytes] = []
    pos = 0
    for tag in (_INTEGER, _INTEGER, _OCTET_STRING, _OCTET_STRING):
        element = read_tlv(body, pos, tag)
        if element is None:
            return None
        fields.append(element[0])
        pos = element[1]
    if pos != len(body):
        return None
    x, y = _read_unsigned(fields[0], P), _read_unsigned(fields[1], P)
    c3, c2 = fields[2], fields[3]
    if x is None or y is None or len(c3) != SIZE or not c2:
        return None
    return Sm2Ciphertext(x.to_bytes(SIZE, "big"), y.to_bytes(SIZE, "big"), c3, c2)


def _raw_body(data: bytes, prefix: bool) -> bytes | None:
    """``data`` without its 0x04 prefix (when ``prefix``), if it holds C1 (both coordinates
    below p), C3 and some C2 in either raw order; None if not."""
    if prefix:
        if data[:1] != POINT_PREFIX:
            return None
        data = data[1:]
    if len(data) < _MIN_RAW or not _coordinates(data[:SIZE], data[SIZE:_C1]):
        return None
    return data


def parse_c1c3c2(data: bytes, *, prefix: bool) -> Sm2Ciphertext | None:
    body = _raw_body(data, prefix)
    if body is None:
        return None
    return Sm2Ciphertext(body[:SIZE], body[SIZE:_C1], body[_C1 : _C1 + SIZE], body[_C1 + SIZE :])


def parse_c1c2c3(data: bytes, *, prefix: bool) -> Sm2Ciphertext | None:
    body = _raw_body(data, prefix)
    if body is None:
        return None
    return Sm2Ciphertext(body[:SIZE], body[SIZE:_C1], body[-SIZE:], body[_C1:-SIZE])


def candidates(data: bytes, fmt: str) -> list[Sm2Ciphertext]:
    """Every structurally valid reading of ``data`` in ``fmt``, most likely first.

    The first byte alone cannot decide: without the 0x04 prefix, x1 starts with 0x04 one time in
    256, and a raw ciphertext may happen to parse as DER. The caller tries each reading; the C3
    check inside the decryption decides.
    """
    readings: list[Sm2Ciphertext | None]
    if fmt == "sm2":
        readings = [
            parse_der(data),
            parse_c1c3c2(data, prefix=True),
            parse_c1c3c2(data, prefix=False),
        ]
    elif fmt == "sm2-c1c2c3":
        readings = [parse_c1c2c3(data, prefix=True), parse_c1c2c3(data, prefix=False)]
    else:
        raise ValueError(f"unknown SM2 ciphertext format {fmt!r}")
    return [reading for reading in readings if reading is not None]


# --- signatures -------------------------------------------------------------------------------


def signature_to_raw(der: bytes) -> bytes | None:
    """DER ``SEQUENCE { r, s }`` to fixed-length r || s."""
    outer = read_tlv(der, 0, _SEQUENCE)
    if outer is None or outer[1] != len(der):
        return None
    r_element = read_tlv(outer[0], 0, _INTEGER)
    if r_element is None:
        return None
    s_element = read_tlv(outer[0], r_element[1], _INTEGER)
    if s_element is None or s_element[1] != len(outer[0]):
        return None
    r = _read_unsigned(r_element[0], 1 << (8 * SIZE))
    s = _read_unsigned(s_element[0], 1 << (8 * SIZE))
    if r is None or s is None:
        return None
    return r.to_bytes(SIZE, "big") + s.to_bytes(SIZE, "big")


def signature_to_der(raw: bytes) -> bytes | None:
    """Fixed-length r || s to DER; None unless exactly 64 bytes."""
    if len(raw) != 2 * SIZE:
        return None
    r, s = int.from_bytes(raw[:SIZE], "big"), int.from_bytes(raw[SIZE:], "big")
    return tlv(_SEQUENCE, der_integer(r) + der_integer(s))


# --- keys -------------------------------------------------------------------------------------


def sec1_private_key(scalar: bytes) -> bytearray:
    """RFC 5915 ``ECPrivateKey`` on the SM2 curve without the public key (libcrypto derives it).

    A bytearray so the caller can wipe it after use.
    """
    if len(scalar) != SIZE:
        raise ValueError("SM2 private scalar must be 32 bytes")
    parameters = tlv(0xA0, SM2_CURVE_OID)  # [0] namedCurve
    # SEQUENCE { INTEGER 1, OCTET STRING scalar, parameters }, built in place: nothing to wipe
    # but the returned buffer.
    key = bytearray((_SEQUENCE, 5 + SIZE + len(parameters), _INTEGER, 1, 1, _OCTET_STRING, SIZE))
    key += scalar
    key += parameters
    return key
