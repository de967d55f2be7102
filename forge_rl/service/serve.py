"""`forge-rl serve`: the meshes of one base model behind the Tinker API, until Ctrl-C.

    forge-rl serve --model.path models/SmolLM2-135M-Instruct --port 8000
    # then, from any Python with the official SDK:
    #   tinker.ServiceClient(base_url="http://127.0.0.1:8000", api_key="local").create_lora_training_client(...)

Top to bottom: the service directory and the weight store (the lifecycle a run has), the hosts,
the processes (trainer ranks, generator pool, store), the engines and the trainer started, then
the HTTP server; `<service dir>/server.json` says where it listens while it does. Ctrl-C (or
SIGTERM) stops the server, then every process, leaving nothing behind but the service directory,
and prints the summary; a process that dies stops the service the same way and names itself.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Callable

from forge_rl.observability.metrics import progress
from forge_rl.run import launch
from forge_rl.run.lifecycle import Lifecycle
from forge_rl.service.config import ServeConfig
from forge_rl.service.meshes import MeshBackend
from forge_rl.service.server import ServiceLimits, ServiceServer, build_app

SERVER_FILE = "server.json"
"""In the service directory once the server listens: {"url", "base_model", "pid"}."""


async def serve(
    config: ServeConfig, stop: asyncio.Event | None = None, on_ready: Callable[[str], None] | None = None
) -> dict:
    """Serve until `stop` is set (or the task is cancelled: Ctrl-C); returns the summary.
    `on_ready` is called with the server's URL once it listens (a notebook serving from its own
    event loop waits for it)."""
    run = config.run_config()
    lifecycle = Lifecycle.open(run)
    if "torch" in sys.modules:  # this process only orchestrates: the cores are the engines' and the trainer's
        sys.modules["torch"].set_num_threads(1)
    async with lifecycle.owning_processes():
        hosts = await launch.start_hosts(run, lifecycle.model_dir)
        lifecycle.stop_at_exit(hosts)
        backend = await MeshBackend.spawn(config, hosts, lifecycle)
        progress("starting the vLLM engine(s) and the trainer (engine start takes tens of seconds on a CPU)")
        started = await backend.start()
        app = build_app(backend, config.api_key, ServiceLimits(max_body_bytes=int(config.max_request_mb * 2**20)))
        server = ServiceServer(app, config.host, config.port)
        await server.start()
        url = server.url
        (lifecycle.run_path / SERVER_FILE).write_text(json.dumps({"url": url, "base_model": backend.base_model}))
        progress(f"serving the Tinker API for {backend.base_model} at {url} ({_how_to_stop()})")
        if on_ready is not None:
            on_ready(url)
        try:
            await lifecycle.serve_until(stop.wait() if stop is not None else asyncio.Event().wait())
        except asyncio.CancelledError:
            if lifecycle.process_failures:  # a process died: the lifecycle says which
                raise
            # Ctrl-C or SIGTERM: a service's normal end. Stopping here, not by the cancellation
            # unwinding the lifecycle, keeps the service directory (the tenants' metrics and saved
            # states), which a run stopped before its first step would lose.
            task = asyncio.current_task()
            assert task is not None  # in a coroutine, run by its task
            task.uncancel()
            progress("stopping: the server, then every process of the service")
        finally:
            (lifecycle.run_path / SERVER_FILE).unlink(missing_ok=True)
            await server.stop()
            backend.close()
    return {"service_dir": str(lifecycle.run_path), "url": url, **started, **server.metrics()}


def _how_to_stop() -> str:
    # A shell without job control starts background commands with SIGINT ignored: there Ctrl-C
    # (or a supervisor's SIGINT) never reaches the service, and saying so spares a hunt.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return "SIGINT is ignored in this process, as in a background job: SIGTERM stops it"
    return "Ctrl-C stops it"
