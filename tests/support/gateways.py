"""Building gateways in tests: config dicts for the fake worker and for the real engine, and the types of
the fixtures in ``tests/conftest.py`` that start them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.server.app import GatewayApp
from tests.support.fakes import ServerThread


def base_config(worker_urls: list[str], plugins: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "models": [{"name": "m1", "aliases": ["alias-1"], "workers": worker_urls}],
        "plugins": plugins if plugins is not None else [{"name": "routing"}],
        "upstream": {"connect_timeout_s": 1, "first_byte_timeout_s": 5, "idle_timeout_s": 2, "health_interval_s": 0.5},
    }
    config.update(extra)
    return config


GatewayFactory = Callable[..., contextlib.AbstractContextManager[tuple[GatewayApp, ServerThread]]]


# -- the real engine ------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
ENGINE_MODEL = "smollm2"
ENGINE_ADMIN_TOKEN = "e2e-admin-token"  # the real engine's admin API (per-model vLLM versions, ...)


@dataclass
class RealEngine:
    """A gateway whose lifespan started one managed vLLM CPU worker with the default model."""

    gateway_url: str
    url: str  # the worker itself (OpenAI server), for tests that build their own gateways
    app: GatewayApp
    model: str = ENGINE_MODEL

    def output_sections(self) -> list[tuple[str, str]]:
        """Each managed worker's last output lines, for the report of a test that failed: a worker's own
        error (vLLM's traceback behind an HTTP 500) is otherwise only in its log."""
        engine = self.app.state.engine
        workers = engine.workers if engine is not None else {}
        return [
            (f"worker {name}: last output lines", "\n".join(worker.last_lines()) or "(no output)")
            for name, worker in sorted(workers.items())
        ]


def engine_config(worker_port: int, plugins: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "models": [{"name": ENGINE_MODEL, "aliases": ["default"], "workers": ["cpu-0"], "max_model_len": 2048}],
        "engine": {
            "workers": [
                {
                    "name": "cpu-0",
                    "model": ENGINE_MODEL,
                    "served_model_name": ENGINE_MODEL,
                    "port": worker_port,
                    "dtype": "bfloat16",
                    "max_model_len": 2048,
                    "kv_cache_space_gb": 1,
                    "max_num_seqs": 32,
                    "enforce_eager": True,
                    "structured_outputs_backend": "outlines",
                    # function calling as config.yaml sets it up (without tools the template changes nothing)
                    "enable_auto_tool_choice": True,
                    "tool_call_parser": "xlam",
                    "chat_template": "smollm2_tools",
                }
            ],
            "ready_timeout_s": 600,
        },
        "plugins": plugins if plugins is not None else [{"name": "routing"}],
        "upstream": {"first_byte_timeout_s": 300, "idle_timeout_s": 120, "health_interval_s": 1},
    }
