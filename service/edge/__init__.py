"""The server side of the wire: the HTTP/1.1 protocol cryptd runs under uvicorn, its limits,
and TLS. Nothing here knows the API; the API knows nothing of this package."""
