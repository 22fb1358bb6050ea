"""Submitting one unseal share to every server worker behind one address.

Each worker of a sealed server keeps its own shares (service/api/sealed.py), and the kernel
spreads new connections over the workers (one SO_REUSEPORT socket each): new connections are
opened until ``/readyz`` has named every worker index, and the share goes to each worker not
yet unsealed, over that worker's own connection, as a signed request.
"""

from __future__ import annotations

import base64
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from cryptd_client.signing import sign_request

UNSEAL_PATH = "/v1/sys/unseal"


@dataclass
class Report:
    workers: int = 0
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        complete = self.workers > 0 and len(self.answers) == self.workers
        return complete and all("error" not in answer for answer in self.answers.values())

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"workers": {str(k): v for k, v in sorted(self.answers.items())}}
        if len(self.answers) < self.workers:
            missing = sorted(set(range(self.workers)) - set(self.answers))
            body["unreached"] = missing
        return body


def _load(credential: Path) -> dict[str, Any]:
    try:
        data = orjson.loads(credential.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"credential {credential} cannot be read ({exc})") from None
    if not isinstance(data, dict) or not {"url", "client_id", "secret"} <= data.keys():
        raise ValueError(f"credential {credential} needs url, client_id and secret")
    return data


def submit_everywhere(
    credential: Path, share: str, *, url: str | None = None, timeout: float = 30.0
) -> Report:
    data = _load(credential)
    base = (url or str(data["url"])).rstrip("/")
    verify: ssl.SSLContext | bool = True
    if data.get("ca_file") or data.get("cert_file"):
        ca_file = data.get("ca_file")
        verify = ssl.create_default_context(
            cafile=None if not ca_file else str(credential.parent / ca_file)
        )
        if data.get("cert_file"):  # mutual TLS: present the client certificate too
            key_file = data.get("key_file")
            verify.load_cert_chain(
                str(credential.parent / data["cert_file"]),
                None if not key_file else str(credential.parent / key_file),
            )
    secret = base64.b64decode(data["secret"])
    body = orjson.dumps({"share": share})
    report = Report()
    opened: list[httpx.Client] = []
    deadline = time.monotonic() + timeout
    try:
        while report.workers == 0 or len(report.answers) < report.workers:
            if time.monotonic() > deadline:
                break
            client = httpx.Client(
                base_url=base,
                verify=verify,
                timeout=30,
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
            )
            opened.append(client)  # kept open: the next connection then hashes elsewhere
            server = client.get("/readyz").json()["checks"]["server"]
            worker, report.workers = int(server["worker"]), int(server["workers"])
            if worker in report.answers:
                continue
            while True:  # signed afresh for every try
                headers = sign_request("POST", UNSEAL_PATH, "", body, data["client_id"], secret)
                answer = client.post(UNSEAL_PATH, content=body, headers=headers)
                # 503 with Retry-After (a fresh replay store's window, an overload): refused
                # before the share was looked at, so sending it again counts it once.
                wait = _retry_after(answer)
                if wait is None or time.monotonic() + wait > deadline:
                    break
                time.sleep(wait)
            try:
                parsed = answer.json()
            except ValueError:
                parsed = {"error": {"code": "internal", "message": answer.text[:200]}}
            report.answers[worker] = (
                parsed
                if answer.status_code == 200
                else {
                    "error": parsed.get("error", parsed),
                    "status": answer.status_code,
                }
            )
    finally:
        for client in opened:
            client.close()
    return report


def _retry_after(answer: httpx.Response) -> float | None:
    """Seconds to wait before sending again, for a 503 that says when (at most 5 s)."""
    if answer.status_code != 503:
        return None
    value = answer.headers.get("retry-after", "")
    return min(float(value), 5.0) if value.isdigit() else None
