"""The text table of ``cryptd bench``: ops/s per algorithm and operation, the payload-size table,
the thread speed-up and SM2 against its references, with ratios measured in the same run."""

from __future__ import annotations

from collections.abc import Sequence

from loadtest.algorithms import pq, rates

TITLES = {
    "sm2": "SM2",
    "rsa-2048": "RSA-2048",
    "ecdsa-p256": "ECDSA-P256",
    "ed25519": "Ed25519",
    "gmssl": "gmssl",
    "sm2-hybrid": "SM2 hybrid",
    "rsa-2048-hybrid": "RSA hybrid",
    "sm2-raw": "SM2 raw",
    "gmssl-raw": "gmssl raw",
}

# Key types in the post-quantum tables and chart; a type not named here shows its own name.
TYPE_TITLES = {
    "ml-dsa-44": "ML-DSA-44",
    "ml-dsa-65": "ML-DSA-65",
    "ml-dsa-87": "ML-DSA-87",
    "ml-kem-768": "ML-KEM-768",
    "ml-kem-1024": "ML-KEM-1024",
    "x25519-ml-kem-768": "X-Wing",
    "rsa-2048": "RSA-2048",
    "rsa-3072": "RSA-3072",
    "ecdsa-p256": "ECDSA P-256",
    "ed25519": "Ed25519",
    "sm2": "SM2",
    pq.REFERENCE: "ML-DSA-65 (fast-mldsa)",
}


def type_title(name: str) -> str:
    return TYPE_TITLES.get(name, name)


def rate_label(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def size_label(size: int) -> str:
    return f"{size // 1024} KiB" if size >= 1024 and size % 1024 == 0 else f"{size} B"


def _row(cells: Sequence[str], widths: Sequence[int]) -> str:
    first, rest = cells[0].ljust(widths[0]), cells[1:]
    return first + "".join(c.rjust(w) for c, w in zip(rest, widths[1:], strict=True))


def _bytes(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _public_key(sizes: dict[str, int | None]) -> str:
    raw = sizes.get("public_key_raw")
    return f"{raw:,} raw" if raw is not None else _bytes(sizes.get("public_key"))


def render_pq(report: rates.Report) -> list[str]:
    """The post-quantum key types against the classical ones: ops/s and sizes per type, and
    each operation's rate against RSA-2048's (x: higher is faster)."""
    lines = [
        "",
        "key types through cryptd's handles (ops/s, one thread; /RSA: the rate against "
        "RSA-2048's in this run)",
        f"bytes: signature of 32 B, token body of a {pq.DATA_KEY_BYTES}-byte data key, KEM "
        "ciphertext; token: its characters as the API returns it;",
        "public key: SPKI DER bytes (raw where the type has no SPKI)",
    ]

    def present(names: tuple[str, ...], operations: tuple[str, ...]) -> list[str]:
        return [
            n for n in names if any(report.rate(pq.label(n), op) is not None for op in operations)
        ]

    def against_rsa(key: str, operation: str) -> str:
        rsa = report.rate(pq.label("rsa-2048"), operation)
        return _times(rates.ratio(report.rate(key, operation), rsa))

    signing = present(pq.SIGNING, pq.SIGN_OPERATIONS)
    if report.rate(pq.REFERENCE, "sign") is not None:
        signing.append(pq.REFERENCE)
    if signing:
        widths = [24, 10, 10, 10, 12, 9, 12]
        header = ["signature", "sign/s", "verify/s", "sign/RSA", "verify/RSA", "bytes"]
        lines.append(_row([*header, "public key"], widths))
        for name in signing:
            key = name if name == pq.REFERENCE else pq.label(name)
            sizes = report.sizes.get(name, {})
            cells = [
                type_title(name),
                rate_label(report.rate(key, "sign")),
                rate_label(report.rate(key, "verify")),
                *(against_rsa(key, op) for op in pq.SIGN_OPERATIONS),
                _bytes(sizes.get("signature")),
                _public_key(sizes),
            ]
            lines.append(_row(cells, widths))
    encrypting = present(pq.ENCRYPTING, ("encrypt", "decrypt"))
    if encrypting:
        widths = [24, 10, 10, 12, 12, 8, 8, 12]
        header = ["encryption", "encrypt/s", "decrypt/s", "encrypt/RSA", "decrypt/RSA"]
        lines.append(_row([*header, "token", "bytes", "public key"], widths))
        for name in encrypting:
            sizes = report.sizes.get(name, {})
            cells = [
                type_title(name),
                *(rate_label(report.rate(pq.label(name), op)) for op in ("encrypt", "decrypt")),
                *(against_rsa(pq.label(name), op) for op in ("encrypt", "decrypt")),
                _bytes(sizes.get("token")),
                _bytes(sizes.get("ciphertext")),
                _public_key(sizes),
            ]
            lines.append(_row(cells, widths))
    kems = present(pq.ENCRYPTING, ("encapsulate", "decapsulate"))
    if kems:
        widths = [24, 10, 10, 8]
        lines.append(_row(["KEM", "encaps/s", "decaps/s", "bytes"], widths))
        for name in kems:
            ops = ("encapsulate", "decapsulate")
            cells = [
                type_title(name),
                *(rate_label(report.rate(pq.label(name), op)) for op in ops),
                _bytes(report.sizes.get(name, {}).get("encapsulation")),
            ]
            lines.append(_row(cells, widths))
    return lines


def render(report: rates.Report) -> str:
    meta = report.meta
    lines = [
        f"cryptd bench: ops/s, one thread, {report.seconds:g} s per figure "
        f"(Python {meta['python']}, {meta.get('pyca', '')}, SM2: {meta['libcrypto']}, "
        f"{meta['machine']}, {meta['cpus']} CPUs)",
    ]
    if report.sizes:
        lines += render_pq(report)
    if not any(r.backend in rates.BACKENDS for r in report.results):
        return "\n".join(lines) + "\n"
    lines.append("")
    backends = [b for b in rates.BACKENDS if any(r.backend == b for r in report.results)]
    widths = [16] + [12] * len(backends) + [14, 11]
    header = ["operation", *(TITLES[b] for b in backends), "SM2/RSA-2048", "SM2/gmssl"]
    lines.append(_row(header, widths))
    ratios = rates.ratios(report)
    for operation in rates.OPERATIONS:
        label = operation
        if operation in ("encrypt", "decrypt"):
            label = f"{operation} {rates.KEY_PAYLOAD} B"
        cells = [label, *(rate_label(report.rate(b, operation)) for b in backends)]
        cells += [_times(ratios[operation]["sm2/rsa-2048"]), _times(ratios[operation]["sm2/gmssl"])]
        lines.append(_row(cells, widths))

    sizes = sorted({r.payload for r in report.results if r.payload is not None})
    if sizes:
        lines += [
            "",
            "payload size (ops/s); hybrid = the service's encrypt, raw = SM2 of the payload",
        ]
        payload_backends = [
            b for b in rates.PAYLOAD_BACKENDS if any(r.backend == b for r in report.results)
        ]
        widths = [10, 9] + [13] * len(payload_backends) + [14, 16]
        header = ["payload", "op", *(TITLES[b] for b in payload_backends)]
        lines.append(_row([*header, "SM2/RSA hyb", "SM2/gmssl raw"], widths))
        for size in sizes:
            for operation in ("encrypt", "decrypt"):
                by_backend = {b: report.rate(b, operation, size) for b in payload_backends}
                cells = [
                    size_label(size),
                    operation,
                    *(rate_label(by_backend[b]) for b in payload_backends),
                ]
                cells.append(
                    _times(rates.ratio(by_backend["sm2-hybrid"], by_backend["rsa-2048-hybrid"]))
                )
                cells.append(
                    _times(rates.ratio(by_backend["sm2-raw"], by_backend.get("gmssl-raw")))
                )
                lines.append(_row(cells, widths))

    threaded = [r for r in report.results if r.threads > 1]
    if threaded:
        lines += [
            "",
            f"SM2 on 1 and {threaded[0].threads} threads (libcrypto runs without the GIL)",
        ]
        for r in threaded:
            single = report.rate(rates.THREADS, r.operation)
            speedup = _times(rates.ratio(r.ops_per_s, single))
            before, after = rate_label(single), rate_label(r.ops_per_s)
            lines.append(f"  {r.operation:<8} {before:>8}/s -> {after:>8}/s ({speedup})")

    lines += [
        "",
        "SM2 against the pure-Python gmssl and against RSA-2048's private-key operation "
        "(PSS signing, measured alongside)",
    ]
    for row in rates.references(report):
        lines.append(
            f"  {row['operation']:<8} {rate_label(row['sm2']):>8}/s"
            f"  {_times(row['vs_gmssl']):>8} gmssl"
            f"  {_times(row['vs_rsa_private']):>6} RSA-2048 private"
            f" ({rate_label(row['rsa_private'])}/s)"
        )
    return "\n".join(lines) + "\n"
