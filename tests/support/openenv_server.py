"""OpenEnv's echo environment served by OpenEnv's own server (`create_app`: HTTP and WebSocket)
on the loopback interface, for the tests of verifiers' OpenEnv environment, whose client reaches
an OpenEnv environment over the network (`OpenEnvConfig.base_url`). The environment is the one
`openenv init` writes (forge_rl/envs/openenv_adapter.py `_echo_env_classes`), unmodified; the
server is what its generated app.py builds, with room for several sessions at once (app.py allows
one). uvicorn runs in a thread of the test process on 127.0.0.1, port chosen by the kernel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import socket
import threading
import time
from collections.abc import Iterator

import pytest

PRINTABLE = "".join(chr(c) for c in range(32, 127))
"""verifiers' OpenEnv payloads are JSON: the tests' character tokenizer spells printable ASCII."""

OPENENV_FOR_VERIFIERS = "0.4.1"
"""The OpenEnv client verifiers 0.4's OpenEnv taskset is written against (its `openenv` extra:
`openenv>=0.4.1`, the package openenv-core was renamed to); openenv-core 0.3.0's client lacks
what it reads (`GenericEnvClient._base_url`)."""


def require_openenv_for_verifiers() -> None:
    """Skip unless the installed OpenEnv is one verifiers' OpenEnv taskset can drive."""
    from packaging.version import Version

    try:
        version = importlib.metadata.version("openenv")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None or Version(version) < Version(OPENENV_FOR_VERIFIERS):
        pytest.skip(
            f"verifiers' OpenEnv taskset needs openenv >= {OPENENV_FOR_VERIFIERS} (verifiers[openenv]); "
            f"installed: openenv {version}. Run make env-adapters."
        )


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    """The served echo environment's base URL, for a test module (skips without openenv >= 0.4.1)."""
    require_openenv_for_verifiers()
    with serve_echo_env() as url:
        yield url


@contextlib.contextmanager
def serve_echo_env(max_sessions: int = 8) -> Iterator[str]:
    """OpenEnv's echo environment served on 127.0.0.1; yields its base URL."""
    import uvicorn
    from openenv.core.env_server.http_server import create_app

    from forge_rl.envs.openenv_adapter import _echo_env_classes

    environment_class, action_class = _echo_env_classes()
    from echo_env.models import EchoObservation

    app = create_app(
        environment_class, action_class, EchoObservation, env_name="echo_env", max_concurrent_envs=max_sessions
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="openenv-echo")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("OpenEnv's echo server did not start within 30 s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
