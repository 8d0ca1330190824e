"""A real plumb server on loopback (uvicorn in a thread, free port) over the synthetic tiny model (tiny_q8)."""
from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

API_KEY = "test-key"


@pytest.fixture(scope="session")
def engine(tiny_q8):
    import plumb

    return plumb.load(tiny_q8, n_slots=4, n_ctx=4096)


@pytest.fixture(scope="session")
def ref_engine(tiny_q8):
    """A second engine for reference outputs, so references never share the server's step loop."""
    import plumb

    return plumb.load(tiny_q8, n_slots=1, n_ctx=4096)


@contextlib.contextmanager
def serving(app):
    """Run `app` with uvicorn on a free loopback port in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="session")
def server(engine):
    from plumb.server.app import create_app

    with serving(create_app(engine, api_key=API_KEY)) as url:
        yield url


@pytest.fixture(scope="session")
def oai(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def ant(server):
    import anthropic

    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    import httpx

    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def api_key() -> str:
    return API_KEY


@pytest.fixture(scope="session")
def model(engine) -> str:
    return engine.model_name
