"""The console in a real browser (Debian's headless Chromium, driven by Playwright) against a
real `lockstep serve`, with two tenants training through the real tinker SDK meanwhile.

Screenshots are written to this test's tmp dir (pytest keeps the last runs' dirs; the path is
printed). Without Chromium, or without the playwright package, the tests skip and say why.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from lockstep.devserver import Server, start_server, stop_server
from lockstep.keyring import owner_of
from tests import sdk_sessions

from .browser import WAIT_MS, chromium, require_browser, sign_in_by_keyboard, unlabelled

pytestmark = pytest.mark.e2e

OWNER_KEY = "tml-console-owner"
OTHER_KEY = "tml-console-other"
ADMIN_KEY = "tml-console-admin"
BUDGET_BYTES = 300_000  # everything one page loads: HTML, views, script, style


@dataclass
class Tenant:
    service: Any = None  # kept: the SDK closes its client holder with its last ServiceClient
    client: Any = None
    steps: int = 0
    samplers: list[str] = field(default_factory=list)
    error: BaseException | None = None


def _train(tenant: Tenant, stop: threading.Event) -> None:
    """SFT steps on a fixed batch until `stop`; sampler checkpoints after steps 1 and 3, a
    training checkpoint after step 1."""
    from tinker import types

    try:
        tc = tenant.client
        tokens = list(range(10, 58))
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np.array(tokens[1:])),
                "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, np.float32)),
            },
        )
        while not stop.is_set():
            tc.forward_backward([datum] * 4, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
            tenant.steps += 1
            if tenant.steps in (1, 3):
                saved = tc.save_weights_for_sampler(f"s{tenant.steps}").result()
                tenant.samplers.append(saved.path)
            if tenant.steps == 1:
                tc.save_state("w1").result()
    except BaseException as exc:  # reported by the fixture
        tenant.error = exc


@pytest.fixture(scope="module")
def console_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    require_browser()
    srv = start_server(tmp_path_factory.mktemp("console") / "data", "--admin-key", ADMIN_KEY)
    yield srv
    assert stop_server(srv) == 0, srv.log()[-5000:]


@pytest.fixture(scope="module")
def tenants(console_server: Server) -> Iterator[list[Tenant]]:
    """Two tenants training in threads. Their sessions are this fixture's own (not closed by
    the conftest hook before this teardown runs): the threads stop first, then the sessions
    close, so no step is cut off by its session's end."""
    import tinker

    stop = threading.Event()
    pair = [Tenant(), Tenant()]
    with sdk_sessions.collect() as services:
        for t in pair:
            t.service = tinker.ServiceClient(base_url=console_server.base_url, api_key=OWNER_KEY)
            t.client = t.service.create_lora_training_client(
                base_model="Lockstep/tiny-qwen3", rank=8
            ).result()
    threads = [threading.Thread(target=_train, args=(t, stop), daemon=True) for t in pair]
    for t in threads:
        t.start()
    yield pair
    stop.set()
    for t in threads:
        t.join(WAIT_MS / 1000)
    assert not any(t.is_alive() for t in threads), "a tenant's step did not finish"
    sdk_sessions.close(services)
    assert all(t.error is None for t in pair), [t.error for t in pair]


@pytest.fixture()
def browser() -> Iterator[Any]:
    with chromium() as context:
        yield context


def test_a_key_watches_its_tenants_train_downloads_and_samples(
    console_server: Server, tenants: list[Tenant], browser: Any, tmp_path: Path
) -> None:
    base = console_server.base_url
    page = browser.new_page()
    responses: list[Any] = []
    page.on("response", lambda r: responses.append(r))
    sign_in_by_keyboard(page, base, OWNER_KEY)
    assert unlabelled(page) == []

    # Two tenants training: both runs listed, and their steps move while we watch.
    page.wait_for_function(
        "() => document.querySelectorAll('tr[data-run]').length == 2", timeout=WAIT_MS
    )
    steps = (
        "[...document.querySelectorAll('tr[data-run] td:nth-of-type(4)')].map(e => +e.textContent)"
    )
    first = page.evaluate(steps)
    page.wait_for_function(
        f"(first) => {steps}.every((n, i) => n > first[i])", arg=first, timeout=WAIT_MS
    )
    page.screenshot(path=tmp_path / "runs.png", full_page=True)

    # Open a run with the keyboard: Tab to its link, Enter.
    run_id = tenants[0].client.model_id
    for _ in range(40):
        if (
            page.evaluate("document.activeElement.getAttribute('href')")
            == f"/console/runs/{run_id}"
        ):
            break
        page.keyboard.press("Tab")
    responses.clear()
    page.keyboard.press("Enter")
    page.wait_for_url(f"**/console/runs/{run_id}")
    chart = 'svg[data-metric="loss:sum"]'
    page.wait_for_selector(chart, timeout=WAIT_MS)
    loaded = sum(len(r.body()) for r in responses if r.ok)
    assert loaded < BUDGET_BYTES, f"the run page loaded {loaded} bytes"
    points = int(page.get_attribute(chart, "data-points") or 0)
    page.wait_for_function(  # the chart moves: the live part refreshes with new steps
        f"(n) => +document.querySelector('{chart}').dataset.points > n", arg=points, timeout=WAIT_MS
    )
    assert unlabelled(page) == []
    page.screenshot(path=tmp_path / "run.png", full_page=True)

    # Download the training checkpoint: signed links, no key in any URL.
    page.wait_for_selector('tr[data-checkpoint="weights/w1"]', timeout=WAIT_MS)
    page.click('tr[data-checkpoint="weights/w1"] button[data-action="download"]')
    link = page.locator('tr[data-checkpoint="weights/w1"] a', has_text="adapter_config.json")
    with page.expect_download() as info:
        link.click()
    saved = tmp_path / "adapter_config.json"
    info.value.save_as(saved)
    on_disk = next(console_server.data_dir.rglob("weights/w1/adapter_config.json"))
    assert saved.read_bytes() == on_disk.read_bytes()
    assert OWNER_KEY not in (link.get_attribute("href") or "")

    # Its expiry, as `tinker checkpoint set-ttl` sets it: hours from now, then never again.
    row = page.locator('tr[data-checkpoint="weights/w1"]')
    expires_cell = (
        "document.querySelector('tr[data-checkpoint=\"weights/w1\"] [data-field=expires]')"
    )
    assert row.locator('[data-field="expires"]').inner_text() == "never"
    page.once("dialog", lambda dialog: dialog.accept("2"))
    asked = time.time()
    row.locator('button[data-action="expiry"]').click()
    page.wait_for_function(f"() => {expires_cell}.textContent !== 'never'", timeout=WAIT_MS)
    with httpx.Client(base_url=base, headers={"X-API-Key": OWNER_KEY}) as api:
        listed = api.get(f"/api/v1/training_runs/{run_id}/checkpoints").json()["checkpoints"]
    (w1,) = [c for c in listed if c["checkpoint_id"] == "weights/w1"]
    expires = datetime.fromisoformat(w1["expires_at"]).timestamp()
    assert asked + 7200 - 5 <= expires <= time.time() + 7200 + 5, w1
    page.once("dialog", lambda dialog: dialog.accept(""))
    row.locator('button[data-action="expiry"]').click()
    page.wait_for_function(f"() => {expires_cell}.textContent === 'never'", timeout=WAIT_MS)

    # The playground: two sampler checkpoints side by side, N samples each with logprobs.
    deadline = time.monotonic() + WAIT_MS / 1000
    while len(tenants[0].samplers) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)  # its s1 and s3 (saved after steps 1 and 3)
    s1, s3 = tenants[0].samplers[:2]
    page.goto(base + "/console/playground")
    page.wait_for_selector("#playground")
    assert unlabelled(page) == []
    page.get_by_label("Model", exact=True).select_option(s1)
    page.get_by_label("Compare side by side with").check()
    page.get_by_label("Second model").select_option(s3)
    page.get_by_label("Prompt").fill("English: banana split")
    page.get_by_label("Samples").fill("3")
    page.get_by_label("Max tokens").fill("8")
    page.get_by_role("button", name="Sample").click()
    page.wait_for_selector("#samples .column >> nth=1", timeout=WAIT_MS)
    columns = page.locator("#samples .column")
    assert [columns.nth(i).get_attribute("data-model") for i in range(2)] == [s1, s3]
    for i in range(2):
        samples = columns.nth(i).locator(".sample")
        assert samples.count() == 3
        rows = samples.first.locator("tbody tr").count()
        assert rows == 8 or 0 < rows < 8  # 8 tokens, or fewer when the model stopped
        assert "logprob -" in samples.first.inner_text()
    page.screenshot(path=tmp_path / "playground.png", full_page=True)
    print(f"screenshots: {tmp_path}")


def test_another_key_sees_none_of_it(
    console_server: Server, tenants: list[Tenant], browser: Any, tmp_path: Path
) -> None:
    base = console_server.base_url
    page = browser.new_page()
    responses: list[Any] = []
    bodies: list[str] = []
    page.on("response", lambda r: responses.append(r))

    def read() -> None:  # before the page moves on (a page's bodies go with it)
        bodies.extend(r.text() for r in responses if "/console" in r.url)
        responses.clear()

    sign_in_by_keyboard(page, base, OTHER_KEY)
    page.wait_for_selector("text=No training runs yet", timeout=WAIT_MS)
    read()
    run_id = tenants[0].client.model_id
    page.goto(f"{base}/console/runs/{run_id}")
    page.wait_for_selector('section.error[data-status="404"]', timeout=WAIT_MS)
    read()
    page.goto(base + "/console/usage")
    page.wait_for_selector("section.key", timeout=WAIT_MS)
    read()
    page.goto(base + "/console/playground")
    page.wait_for_selector("#playground", timeout=WAIT_MS)
    read()
    page.screenshot(path=tmp_path / "other-key.png", full_page=True)
    owner = owner_of(OWNER_KEY)
    assert len(bodies) >= 8
    for body in bodies:  # nothing of the owner's: its id, checkpoints, metrics
        assert owner not in body and "sampler_weights" not in body and "loss:sum" not in body

    # The API calls behind the pages answer another key as they answer the SDK: 404.
    with httpx.Client(base_url=base, headers={"X-API-Key": OTHER_KEY}) as api:
        for path in ("", "/history", "/futures", "/checkpoints"):
            for scope in ("owned", "accessible"):
                r = api.get(f"/api/v1/training_runs/{run_id}{path}?access_scope={scope}")
                assert r.status_code == 404, (path, r.text)
        listed = api.get("/api/v1/training_runs?access_scope=accessible").json()
        assert listed["training_runs"] == []

    # An admin key reads every key's runs (read only), named by their owner id.
    with httpx.Client(base_url=base, headers={"X-API-Key": ADMIN_KEY}) as admin:
        view = admin.get("/console/view/runs").text
        assert all(t.client.model_id in view for t in tenants) and owner in view
        run = admin.get(f"/console/view/runs/{run_id}").text
        assert "Read only" in run and 'data-action="publish"' not in run
        assert admin.get(f"/api/v1/training_runs/{run_id}").status_code == 404  # owned: its own
