"""The web UI in real Chromium (Debian's chromium, driven by Playwright for Python) against real
warren-server processes: the page loads and lives without reloads; a policy set from the page
(a bad one first: the same message as warrenctl's) makes the mirror appear; a sync started from
the page fills its bar; kill -9 of the leader's node shows the node down, the synchronised
mirror promoted and the timeline with the delivery gap; a new mirror's sync moves its bar and is
cancelled; a purge waits for its confirmation. Each step saves a screenshot under the test's
temporary folder (screens/); WARREN_UI_SCREENSHOT=PATH also copies the one that shows the most
(a sync's bar after a promotion, with the timeline and live rates) to PATH. The same queue name
in another vhost is another card, which names its vhost and whose delete is its own."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import trio

from broker.client.aio import open_connection

from cluster_procs import publish, running_cluster

CHROMIUM = os.environ.get("WARREN_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SYNC_LIMIT = 300_000  # bytes/s: a sync of the ~1.5 MB queue takes ~5 s, long enough to watch

playwright_api = pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed "
                                     "(pip install playwright; its own browsers are not needed)")
pytestmark = [
    pytest.mark.process, pytest.mark.timeout(300),
    pytest.mark.skipif(not (Path(CHROMIUM).exists() and os.access(CHROMIUM, os.X_OK)),
                       reason=f"no Chromium at {CHROMIUM}: apt-get install chromium chromium-driver "
                              "(or set WARREN_CHROMIUM)"),
]


class Traffic:
    """A light steady load (about 100 messages/s published, consumed and acknowledged) on one
    queue, from a thread, so the page's rates and charts have something to show."""

    def __init__(self, c, node: str, queue: str):
        self.addr, self.queue = c.client_addr(node), queue
        self.stop = threading.Event()
        self.thread = threading.Thread(target=trio.run, args=(self._run,), daemon=True)

    async def _run(self):
        async with open_connection([self.addr]) as conn:
            ch = await conn.channel()
            await ch.queue_declare(self.queue, durable=True)

            async def consume():
                async for msg in await ch.basic_consume(self.queue):
                    ch.basic_ack(msg.delivery_tag)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume)
                while not self.stop.is_set():
                    for _ in range(10):
                        await ch.basic_publish("", self.queue, b"tick" * 64)
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


def progress(page, queue: str) -> float:
    bar = page.locator(f'[data-queue="{queue}"] .sync-bar')
    value = bar.get_attribute("data-progress")
    return float(value) if value else 0.0


def test_the_page_drives_and_shows_mirroring(request, tmp_path_factory, tmp_path):
    screens = tmp_path / "screens"
    screens.mkdir()
    step = iter(range(1, 100))

    def shot(page, what: str) -> Path:
        path = screens / f"{next(step):02d}-{what}.png"
        page.screenshot(path=str(path), full_page=True)
        return path

    with running_cluster(request, tmp_path_factory, 3, net_ticktime=8, http=True,
                         server_args=["--mirroring-sync-max-throughput", str(SYNC_LIMIT)]) as c:
        publish(c, "n1", "ha.ui", 1500)
        publish(c, "n2", "scratch", 3)
        with Traffic(c, "n2", "ha.live"), playwright_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(30_000)
                page.goto(f"http://127.0.0.1:{c.http_ports['n2']}/")
                queue = page.locator('[data-queue="ha.ui"]')
                queue.wait_for()
                for name in ("n1", "n2", "n3"):
                    page.wait_for_selector(f'[data-node="{name}"][data-state="running"]')
                assert queue.get_attribute("data-leader") == "n1"
                assert queue.locator('[data-role="mirror"]').count() == 0
                # the rates come live, without a reload
                page.wait_for_function(
                    "() => Number(document.querySelector('[data-queue=\"ha.live\"] .rate-publish')"
                    "?.textContent || 0) > 10")
                shot(page, "loaded")

                # a bad policy: the API's 400, shown with warrenctl's message
                page.fill("#policy-name", "ha-ui")
                page.fill("#policy-pattern", r"^ha\.")
                page.fill("#policy-definition", '{"ha-mode":"bogus"}')
                page.click("#policy-set")
                error = page.locator("#policy-error")
                error.filter(has_text="Validation failed").wait_for()
                cli = c.ctl("n1", "set_policy", "ha-ui", r"^ha\.", '{"ha-mode":"bogus"}')
                assert error.inner_text() in cli.stderr
                shot(page, "policy-refused")

                # a good one: the mirror appears, not synchronised
                page.fill("#policy-definition", '{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"manual"}')
                page.click("#policy-set")
                mirror = queue.locator('[data-role="mirror"]')
                mirror.wait_for()
                assert mirror.get_attribute("data-synced") == "false"
                assert page.locator("#policy-error").inner_text() == ""
                page.wait_for_selector('[data-policy="ha-ui"]')
                first_mirror = mirror.get_attribute("data-replica")
                shot(page, "mirror-added")

                # a sync from the page: its bar moves, then the mirror is synchronised
                queue.locator(".act-sync").click()
                page.wait_for_function(
                    "() => Number(document.querySelector('[data-queue=\"ha.ui\"] .sync-bar')"
                    ".dataset.progress || 0) > 0")
                before = progress(page, "ha.ui")
                shot(page, "sync-running")
                # the bar moves (or, on a slow machine, the sync finished between two polls)
                page.wait_for_function(
                    f"() => Number(document.querySelector('[data-queue=\"ha.ui\"] .sync-bar')"
                    f".dataset.progress || 0) > {before} || document.querySelector("
                    f"'[data-queue=\"ha.ui\"] [data-replica=\"{first_mirror}\"][data-synced=\"true\"]')")
                queue.locator(f'[data-replica="{first_mirror}"][data-synced="true"]').wait_for(timeout=60_000)
                shot(page, "mirror-synchronised")
                # three times the backlog, on the leader and its synchronised mirror: the new
                # mirror that follows the promotion below starts empty, so its sync runs ~15 s
                # and is seen moving twice and cancelled mid-way even on a busy machine
                publish(c, "n1", "ha.ui", 3000)

                # kill -9 of the leader's node: down, the mirror promoted, the timeline's gap
                killed_at = time.monotonic()
                c.kill9("n1")
                page.wait_for_selector('[data-node="n1"][data-state="down"]')
                page.wait_for_function(
                    f"() => document.querySelector('[data-queue=\"ha.ui\"]').dataset.leader === '{first_mirror}'")
                promoted_after = time.monotonic() - killed_at
                promoted = queue.locator('.queue-events .event[data-kind="promoted"]')
                promoted.wait_for()
                assert "delivery gap" in promoted.inner_text()
                assert page.locator('#cluster-events .event[data-kind="node_down"]').count() >= 1
                assert promoted_after < 10, promoted_after  # seen within about two polls of the change
                shot(page, "leader-killed-promoted")

                # the new mirror (exactly 2: on the third node) syncs from the page; cancelled
                other = next(n for n in ("n2", "n3") if n != first_mirror)
                queue.locator(f'[data-replica="{other}"][data-role="mirror"]').wait_for()
                # the bar kept no progress from the first sync (its hidden bar once said 99%
                # until the new sync's first poll, and this test waited to see it pass that)
                assert progress(page, "ha.ui") == 0
                queue.locator(".act-sync").click()
                page.wait_for_function(
                    "() => Number(document.querySelector('[data-queue=\"ha.ui\"] .sync-bar')"
                    ".dataset.progress || 0) > 0")
                first = progress(page, "ha.ui")
                page.wait_for_function(
                    f"() => Number(document.querySelector('[data-queue=\"ha.ui\"] .sync-bar')"
                    f".dataset.progress || 0) > {first}")
                assert "ETA" in queue.locator(".sync-text").inner_text()
                ui_shot = shot(page, "second-sync-running")  # the one docs/images/ui.png shows
                queue.locator(".act-cancel-sync").click()
                page.wait_for_function(
                    "() => document.querySelector('[data-queue=\"ha.ui\"] .sync').hidden")
                assert queue.locator(f'[data-replica="{other}"]').get_attribute("data-synced") == "false"
                queue.locator('.queue-events .event[data-kind="sync_cancelled"]').wait_for()
                shot(page, "sync-cancelled")

                # destructive actions wait for a confirmation
                scratch = page.locator('[data-queue="scratch"]')
                scratch.locator(".act-purge").click()
                page.wait_for_selector("#confirm:not([hidden])")
                shot(page, "purge-confirmation")
                page.click("#confirm-no")
                time.sleep(1.5)
                assert scratch.locator(".depth").inner_text() == "3"
                scratch.locator(".act-delete").click()
                page.click("#confirm-yes")
                scratch.wait_for(state="detached")
                shot(page, "scratch-deleted")
            finally:
                browser.close()
    if os.environ.get("WARREN_UI_SCREENSHOT"):
        shutil.copy(ui_shot, os.environ["WARREN_UI_SCREENSHOT"])


def test_the_same_queue_name_in_another_vhost_is_another_card(request, tmp_path_factory):
    with running_cluster(request, tmp_path_factory, 1, http=True) as c:
        publish(c, "n1", "q", 3)
        with playwright_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(30_000)
                page.goto(f"http://127.0.0.1:{c.http_ports['n1']}/")
                page.locator('[data-queue="q"]').wait_for()
                with httpx.Client(base_url=f"http://127.0.0.1:{c.http_ports['n1']}",
                                  auth=("guest", "guest")) as http:
                    assert http.put("/api/vhosts/tenant", json={}).status_code == 201
                    assert http.put("/api/queues/tenant/q", json={"durable": True}).status_code == 201
                tenant = page.locator('[data-queue="q"][data-vhost="tenant"]')
                tenant.wait_for()
                assert tenant.locator(".vhost").inner_text() == "vhost tenant"
                assert "queue q (vhost tenant) declared" in tenant.locator(".queue-events").inner_text()
                root = page.locator('[data-queue="q"][data-vhost="/"]')
                assert root.locator(".vhost").count() == 0
                tenant.locator(".act-delete").click()
                page.click("#confirm-yes")
                tenant.wait_for(state="detached")
                assert root.locator(".depth").inner_text() == "3"  # the delete was the tenant's
            finally:
                browser.close()
