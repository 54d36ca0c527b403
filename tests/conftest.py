"""Shared test helpers.

`require_system`: tests that need a system tool (a browser, PulseAudio, PortAudio) skip when
it is missing locally, but fail under CI (VOICE_CI=1), where .ci/run installs everything.

`real_stages(config)`: the real models, loaded once per test run, in a fresh `Instance` per module.
`live_voice_server`: the real voice service behind uvicorn on a free port, shared by the client
tests (test_web.py, test_mic.py).

`postgres_server` / `postgres_url`: a throwaway PostgreSQL (tests/postgres.py) for the run, and a
new empty database in it per test (its URL).

Markers (README, "Tests"), set by each module's `pytestmark`: `slow` = the module loads real
models (an LM, Whisper, Piper); `live` = it also drives a real peer or system tool (Chromium,
PulseAudio, sipp/baresip, wyoming-bench), and is slow too. The fast subset, `./dev test -m "not
slow and not live"`, covers the pipeline around fake models; a test that asks for the real models
(`real_stages`) without the `slow` marker is refused at collection, so it cannot slip into it.
"""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(items):
    unmarked = [item.nodeid for item in items
                if "real_stages" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError(f"tests that load the real models must be marked slow (pytestmark): {unmarked}")


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
def real_instance():
    """`real_stages(config)`: a fresh `voice.service.instance.Instance` for `config` (its own metrics, records,
    limits, sessions) around the real models: Whisper, Piper and the default LM, loaded once per
    test run, on the first call. `config`'s asr, tts and lm sections must be the defaults (with
    replies of REAL_REPLY_TOKENS), since the models were loaded for them."""
    from fakes import REAL_REPLY_TOKENS
    from voice.config import Config
    from voice.service.instance import Instance
    loaded: list[Instance] = []

    def build(config: Config) -> Instance:
        if not loaded:
            base = Config()
            base.lm.max_new_tokens = REAL_REPLY_TOKENS
            loaded.append(Instance.load(base))
        models = loaded[0]
        for section in ("asr", "tts", "lm"):
            assert getattr(config, section) == getattr(models.config, section), \
                f"the shared real models were loaded for the default [{section}]"
        return Instance(config, models.whisper, models.synthesizer, models.lm, models.scheduler)

    return build


@pytest.fixture(scope="session")
def live_voice_server(real_instance):
    """Base URL (http://127.0.0.1:PORT) of the real service with the default models, short replies."""
    from fakes import REAL_REPLY_TOKENS
    from liveserver import serving
    from voice.config import Config
    from voice.service.server import build_app

    config = Config()
    config.lm.max_new_tokens = REAL_REPLY_TOKENS
    with serving(build_app(config, real_instance(config))) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def postgres_server(require_system):
    """A throwaway PostgreSQL (tests/postgres.py) for the whole run, started on first use (~1 s)."""
    from postgres import PostgresServer, binaries
    require_system(binaries(), "PostgreSQL's initdb/postgres are not installed (apt-get install postgresql)")
    with PostgresServer() as server:
        yield server


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """postgresql://... of a new, empty database in `postgres_server`, one per test."""
    return postgres_server.create_database()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Modules of small models run with one intra-op thread: on a shared 2-core box that is ~5x faster
    than two fighting other processes (OpenMP spin-waits), and no slower alone."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
