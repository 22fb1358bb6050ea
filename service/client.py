"""The Python client, for code that imported it from the server package: it lives in the
light ``cryptd_client`` distribution (client/ in this repository, httpx only), which the server
distribution ships too. New code imports :mod:`cryptd_client`."""

from __future__ import annotations

from cryptd_client import *  # noqa: F403
from cryptd_client import __all__ as __all__
