"""Client certificate identities, read from the ASGI TLS extension.

The server verified the certificate at the handshake (it chains to ``CRYPTD_TLS_CLIENT_CA_FILE``,
is within its validity period, and the client proved it holds the key). What identifies the
client is what its certificate's subject alternative names say: DNS names and URIs (a SPIFFE ID
such as ``spiffe://example.org/ns/billing/sa/api`` is a URI). The subject's common name is not
an identity here (RFC 6125 and every modern verifier ignore it where SANs exist).

An identity carries its type, ``DNS:<name>`` or ``URI:<uri>`` (OpenSSL's SAN spelling), so a
URI SAN that reads like a host name never stands for the DNS name of the same spelling.
"""

from __future__ import annotations

import functools
from typing import Any

from cryptography import x509

Identities = frozenset[str]
NO_IDENTITIES: Identities = frozenset()
DNS_PREFIX = "DNS:"
URI_PREFIX = "URI:"


@functools.lru_cache(maxsize=4096)
def identities_of(pem: str) -> Identities:
    """The SAN DNS names and URIs of a PEM certificate, typed (``DNS:...``, ``URI:...``);
    parsed once per distinct certificate: every request on a kept-alive connection hands the
    same string."""
    try:
        cert = x509.load_pem_x509_certificate(pem.encode("ascii"))
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return NO_IDENTITIES
    found = [DNS_PREFIX + name for name in names.get_values_for_type(x509.DNSName)]
    found += [URI_PREFIX + uri for uri in names.get_values_for_type(x509.UniformResourceIdentifier)]
    return frozenset(found)


def peer_identities(scope: Any) -> Identities:
    """The identities of the verified client certificate of this request's connection, or
    none (plain HTTP, TLS without a client certificate, a server without the extension)."""
    extensions = scope.get("extensions")
    if not extensions:
        return NO_IDENTITIES
    tls = extensions.get("tls")
    if not tls:
        return NO_IDENTITIES
    chain = tls.get("client_cert_chain")
    if not chain:
        return NO_IDENTITIES
    return identities_of(chain[0])
