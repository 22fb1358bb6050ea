"""The private parts of uvicorn and httptools the HTTP edge (service/edge/) is built on, each
named: the classes it subclasses, the methods it overrides or calls (with the parameters it
passes), the attributes it reads and sets, and the module constants it uses. pyproject.toml
pins uvicorn and httptools to the releases these were checked with; after an upgrade, a
failure here says which one moved, before an edge test fails for a reason hard to find."""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
from collections.abc import Callable, Iterator
from typing import Any

import httptools
import pytest
import uvicorn
from uvicorn.config import Config
from uvicorn.protocols.http.flow_control import FlowControl, service_unavailable
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

from service.edge import response as edge_response
from service.edge.protocol import EdgeLimits, EdgeProtocol
from service.edge.server import STARTUP_FAILURE, EdgeConfig, EdgeServer

# HttpToolsProtocol's methods EdgeProtocol overrides or calls, and their parameters (after
# self) as the edge passes them.
PROTOCOL_METHODS: dict[str, list[str]] = {
    "__init__": ["config", "server_state", "app_state", "_loop"],
    "connection_made": ["transport"],
    "connection_lost": ["exc"],
    "data_received": ["data"],
    "on_response_complete": [],
    "timeout_keep_alive_handler": [],
    "on_message_begin": [],
    "on_url": ["url"],
    "on_header": ["name", "value"],
    "on_headers_complete": [],
    "on_body": ["body"],
    "on_message_complete": [],
    "_start_asgi_task": ["cycle", "app"],
    "_unset_keepalive_if_required": [],
    "_should_upgrade": [],
    "shutdown": [],
}
# HttpToolsProtocol's instance attributes the edge reads or sets: made by __init__ (the
# per-connection ones None until connection_made).
PROTOCOL_ATTRIBUTES = [
    "access_log",
    "access_logger",
    "app",
    "app_state",
    "asgi_version",
    "client",
    "connections",
    "cycle",
    "expect_100_continue",
    "flow",
    "headers",
    "limit_concurrency",
    "logger",
    "loop",
    "parser",
    "pipeline",
    "root_path",
    "scheme",
    "scope",
    "server",
    "server_state",
    "tasks",
    "timeout_keep_alive",
    "timeout_keep_alive_task",
    "transport",
]
# RequestResponseCycle's constructor, called with these arguments in this order
# (EdgeProtocol.on_headers_complete makes an _EdgeCycle positionally).
CYCLE_PARAMETERS = [
    "scope",
    "transport",
    "flow",
    "logger",
    "access_logger",
    "access_log",
    "default_headers",
    "message_event",
    "expect_100_continue",
    "keep_alive",
    "on_response",
]
# Its attributes _EdgeCycle's send and receive read and set.
CYCLE_ATTRIBUTES = [
    "access_log",
    "body",
    "chunked_encoding",
    "default_headers",
    "disconnected",
    "expected_content_length",
    "flow",
    "keep_alive",
    "message_event",
    "more_body",
    "on_response",
    "response_complete",
    "response_started",
    "scope",
    "transport",
    "waiting_for_100_continue",
]
# uvicorn.Config's keyword arguments cryptd passes (service/cli/serve.py, EdgeConfig).
CONFIG_OPTIONS = [
    "access_log",
    "factory",
    "host",
    "http",
    "lifespan",
    "log_config",
    "log_level",
    "loop",
    "port",
    "proxy_headers",
    "server_header",
    "ssl_context_factory",
    "timeout_graceful_shutdown",
    "timeout_keep_alive",
    "ws",
]
# A loaded Config's attributes EdgeServer.startup and EdgeProtocol read.
CONFIG_ATTRIBUTES = [
    "backlog",
    "http_protocol_class",
    "lifespan_class",
    "limit_concurrency",
    "loaded",
    "root_path",
    "ssl",
    "ssl_context_factory",
    "timeout_keep_alive",
]


async def _app(scope: Any, receive: Any, send: Any) -> None:
    """An ASGI app for uvicorn to load; never called here."""


def _config(**options: Any) -> Config:
    config = Config(_app, log_config=None, **options)
    config.load()
    return config


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _parameters(function: Callable[..., Any]) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_the_edge_subclasses_uvicorns_httptools_protocol_and_cycle() -> None:
    assert issubclass(EdgeProtocol, HttpToolsProtocol)
    assert issubclass(edge_response.EdgeCycle, RequestResponseCycle)
    assert issubclass(EdgeConfig, uvicorn.Config)
    assert issubclass(EdgeServer, uvicorn.Server)


@pytest.mark.parametrize(("name", "parameters"), PROTOCOL_METHODS.items())
def test_protocol_methods_the_edge_overrides_or_calls(name: str, parameters: list[str]) -> None:
    method = getattr(HttpToolsProtocol, name, None)
    assert callable(method), f"uvicorn's HttpToolsProtocol has no method {name}"
    assert _parameters(method) == parameters, f"HttpToolsProtocol.{name}'s parameters changed"


def test_protocol_attributes_the_edge_reads_and_sets(loop: asyncio.AbstractEventLoop) -> None:
    protocol = HttpToolsProtocol(_config(), ServerState(), {}, loop)
    missing = [name for name in PROTOCOL_ATTRIBUTES if not hasattr(protocol, name)]
    assert not missing, f"uvicorn's HttpToolsProtocol no longer sets {missing}"
    protocol.on_message_begin()
    assert protocol.url == b"", "HttpToolsProtocol.on_message_begin no longer resets url"
    assert isinstance(protocol.parser, httptools.HttpRequestParser)


def test_response_cycle_constructor_and_attributes(loop: asyncio.AbstractEventLoop) -> None:
    assert _parameters(RequestResponseCycle.__init__) == CYCLE_PARAMETERS, (
        "uvicorn's RequestResponseCycle takes other arguments: _EdgeCycle is made positionally"
    )
    for name in ("send", "receive"):
        assert inspect.iscoroutinefunction(getattr(RequestResponseCycle, name)), name
    assert _parameters(RequestResponseCycle.send) == ["message"]
    logger = logging.getLogger("cryptd.test")
    cycle = RequestResponseCycle(
        {"type": "http"},  # type: ignore[typeddict-item]
        None,  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        logger,
        logger,
        False,
        [],
        asyncio.Event(),
        False,
        True,
        lambda: None,
    )
    missing = [name for name in CYCLE_ATTRIBUTES if not hasattr(cycle, name)]
    assert not missing, f"uvicorn's RequestResponseCycle no longer sets {missing}"


def test_flow_control_the_edge_reads() -> None:
    flow = FlowControl(None)  # type: ignore[arg-type]
    assert (flow.read_paused, flow.write_paused) == (False, False)
    assert callable(flow.pause_reading)
    assert callable(flow.resume_reading)
    assert inspect.iscoroutinefunction(service_unavailable)
    assert _parameters(service_unavailable) == ["scope", "receive", "send"]


def test_httptools_module_constants_the_fast_path_copies() -> None:
    # EdgeCycle writes heads itself and must refuse exactly what uvicorn's send refuses.
    assert HEADER_RE.search(b"x-name") is None
    assert HEADER_RE.search(b"bad name") is not None
    assert HEADER_VALUE_RE.search(b"a value\t") is None
    assert HEADER_VALUE_RE.search(b"a\nvalue") is not None
    assert set(STATUS_LINE) == set(range(100, 600))
    assert STATUS_LINE[200] == b"HTTP/1.1 200 OK\r\n"
    assert edge_response._search_name == HEADER_RE.search
    assert edge_response._search_value == HEADER_VALUE_RE.search


def test_server_state_the_edge_reads() -> None:
    state = ServerState()
    assert state.total_requests == 0
    assert state.default_headers == []
    assert isinstance(state.connections, set)
    assert isinstance(state.tasks, set)


def test_config_options_and_attributes() -> None:
    accepted = set(_parameters(Config.__init__))
    missing = sorted(set(CONFIG_OPTIONS) - accepted)
    assert not missing, f"uvicorn.Config no longer takes {missing}"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    factory_calls: list[tuple[object, object]] = []

    def factory(config: object, default: object) -> ssl.SSLContext:
        factory_calls.append((config, default))
        return context

    config = EdgeConfig(_app, edge=EdgeLimits(), log_config=None, ssl_context_factory=factory)
    config.load()
    missing = [name for name in CONFIG_ATTRIBUTES if not hasattr(config, name)]
    assert not missing, f"a loaded uvicorn.Config no longer has {missing}"
    assert config.http_protocol_class is EdgeProtocol
    # TLSFactory is called as factory(config, default) and its context is the listener's.
    assert config.ssl is context
    assert len(factory_calls) == 1
    assert factory_calls[0][0] is config
    # uvicorn reads the protocol class's ALPN list (EdgeProtocol.alpn_protocols).
    assert "alpn_protocols" in inspect.getsource(Config.load)


def test_server_methods_and_attributes_edge_server_relies_on() -> None:
    assert _parameters(uvicorn.Server.startup) == ["sockets"]
    assert _parameters(uvicorn.Server.on_tick) == ["counter"]
    assert _parameters(uvicorn.Server.run) == ["sockets"]
    server = EdgeServer(_config())
    assert isinstance(server.server_state, ServerState)
    assert (server.started, server.should_exit) == (False, False)
    # uvicorn's _serve makes the lifespan before calling startup, which EdgeServer overrides.
    assert "self.lifespan = config.lifespan_class(config)" in inspect.getsource(
        uvicorn.Server._serve
    )
    # uvicorn's shutdown closes the servers EdgeServer.startup makes, then asks every
    # connection to shut down (EdgeProtocol.shutdown drains the idle ones) and waits for them.
    shutdown = inspect.getsource(uvicorn.Server.shutdown)
    assert "self.servers" in shutdown
    assert "connection.shutdown()" in shutdown
    assert "while self.server_state.connections" in inspect.getsource(
        uvicorn.Server._wait_tasks_to_complete
    )
    lifespan = server.config.lifespan_class(server.config)
    assert inspect.iscoroutinefunction(lifespan.startup)
    assert lifespan.should_exit is False
    assert isinstance(lifespan.state, dict)


def test_startup_failure_status_is_uvicorns() -> None:
    assert uvicorn.config.STARTUP_FAILURE == STARTUP_FAILURE == 3


def test_httptools_parser_api_the_edge_calls() -> None:
    class Target:
        url = b""

        def on_url(self, url: bytes) -> None:
            self.url += url

    target = Target()
    parser = httptools.HttpRequestParser(target)
    parser.set_dangerous_leniencies(lenient_data_after_close=True)
    head = b"GET /a%20b?x=1 HTTP/1.1\r\nHost: h\r\nConnection: upgrade\r\nUpgrade: x\r\n\r\n"
    with pytest.raises(httptools.HttpParserUpgrade) as upgrade:
        parser.feed_data(head + b"rest")
    # EdgeProtocol.data_received resumes after the head at the offset the exception carries.
    assert upgrade.value.args[0] == len(head)
    assert parser.should_upgrade() is True
    assert parser.get_method() == b"GET"
    assert parser.get_http_version() == "1.1"
    assert parser.should_keep_alive() in (True, False)
    url = httptools.parse_url(target.url)
    assert (url.path, url.query) == (b"/a%20b", b"x=1")
    with pytest.raises(httptools.HttpParserError):
        httptools.HttpRequestParser(Target()).feed_data(b"NOT HTTP\r\n\r\n")
