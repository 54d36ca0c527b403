"""Shared test helpers.

`require_system`: tests that need a system tool (a browser, PulseAudio, PortAudio) skip when
it is missing locally, but fail under CI (VOICE_CI=1), where .ci/run installs everything.

`live_voice_server`: the real voice service (all models) behind uvicorn on a free port, loaded
once per test session and shared by the client tests (test_web.py, test_mic.py).

Markers (README, "Tests"): `slow` = the module loads real models (an LM, Whisper, Piper);
`live` = it also drives a real peer or system tool (Chromium, PulseAudio, sipp/baresip). The
fast subset, `./dev test -m "not slow and not live"`, covers the pipeline around fake models.
"""

from __future__ import annotations

import os

import pytest


SLOW = {"test_adapt", "test_asr", "test_bench_eval", "test_engine", "test_quantize", "test_qwen", "test_reliability",
        "test_serve_memory", "test_server", "test_service", "test_tts", "test_twilio", "test_verify"}
LIVE = {"test_mic", "test_sip", "test_web"}


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in SLOW | LIVE:
            item.add_marker(pytest.mark.slow)
        if module in LIVE:
            item.add_marker(pytest.mark.live)


def _require_system(ok: object, reason: str) -> None:
    """Skip (locally) or fail (VOICE_CI=1) when `ok` is falsy."""
    if ok:
        return
    if os.environ.get("VOICE_CI") == "1":
        pytest.fail(f"{reason} (required when VOICE_CI=1; .ci/run installs it)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def require_system():
    """`require_system(condition, reason)`: skip locally / fail in CI when a system tool is missing."""
    return _require_system


@pytest.fixture(scope="session")
def live_voice_server():
    """Base URL (http://127.0.0.1:PORT) of the real service with the default models, short replies."""

    from voice.config import Config
    from voice.server import build_app
    from voice.stages import Stages
    from liveserver import serving

    config = Config()
    config.lm.max_new_tokens = 24
    with serving(build_app(config, Stages.load(config))) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Modules of small models run with one intra-op thread: on a shared 2-core box that is ~5x faster
    than two fighting other processes (OpenMP spin-waits), and no slower alone."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
