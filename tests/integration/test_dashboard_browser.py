"""The dashboard page in a real headless browser (Debian's ``chromium`` driven by Playwright):
it shows the same hit ratio and miss counts as the node's ``/metrics``, updates when more
traffic arrives, shows an unreachable node as down without breaking, titles nodes by their
id, and loads nothing from outside.  Screenshots at 1,280, 1,440 and 1,920 px are saved as
``artifacts/dashboard-<width>.png`` (and ``artifacts/dashboard.png``), and at each width no
text is cut off and nothing overflows the page.

Needs ``pip install playwright`` (its driver only: never ``playwright install``) and
``apt-get install chromium``; skipped, saying so, where either is missing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, NodeProcess, wait_for

from client import KVClient, Namespace, chunk_keys
from kvstore.dashboard.scrape import fetch
from kvstore.dashboard.server import Dashboard, StaticNodes

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
CHROMIUM = os.environ.get("KVSTORE_CHROMIUM", "/usr/bin/chromium")
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip(f"no chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REASONS = ("never_stored", "evicted", "invalidated", "corrupt", "node_down", "deadline")
BLOCK = 256 << 10


def expected(node: NodeProcess) -> dict[str, float]:
    """What the page must show, computed from the node's own /metrics."""
    c = fetch(node.endpoints["metrics"]).counters
    lookups = sum(v for key, v in c.items() if key.startswith("lookups/"))
    hits = sum(v for key, v in c.items() if key.startswith("hits/"))
    tokens = sum(v for key, v in c.items() if key.startswith("hit_tokens/"))
    out = {"ratio": hits / lookups, "lookups": lookups, "tokens": tokens}
    for r in REASONS:
        out[r] = sum(v for key, v in c.items() if key.startswith("misses/") and key.endswith("/" + r))
    return out


def shown(page: Any) -> dict[str, float]:
    got = page.evaluate("""() => {
        const out = {ratio: parseFloat(document.getElementById('hit-ratio').dataset.value),
                     lookups: parseFloat(document.getElementById('lookups').dataset.value),
                     ratio_text: document.getElementById('hit-ratio').textContent,
                     tokens: parseFloat(document.getElementById('hit-tokens').dataset.value),
                     tokens_unit: document.getElementById('hit-tokens').dataset.unit};
        for (const row of document.querySelectorAll('#misses [data-reason]'))
            out[row.dataset.reason] = parseFloat(row.querySelector('.num').dataset.value);
        return out;
    }""")
    return got


def matches(page: Any, want: dict[str, float]) -> bool:
    got = shown(page)
    return (
        abs(got.get("ratio", -1) - want["ratio"]) < 1e-12
        and got["lookups"] == want["lookups"]
        and got["tokens"] == want["tokens"]
        and got["tokens_unit"] == "tokens"
        and all(got.get(r) == want[r] for r in REASONS)
        and got["ratio_text"] == f"{100 * want['ratio']:.1f}%"
    )


@pytest.fixture
def traffic_node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = NodeProcess(tmp_path / "node", "--dram", "2MiB", "--nvme", "0", "--metrics-port", "0").start()
    yield n
    assert n.stop(timeout=30) == 0
    Path(f"/dev/shm/kvstore-test-{n.node_id}.arena").unlink(missing_ok=True)


# every element whose text would be clipped (an ellipsis, or hidden overflow) or that makes the page
# scroll sideways; the charts' SVGs scale to their boxes and are not text boxes
CUT_OFF = """() => {
    const out = [];
    const doc = document.documentElement;
    if (doc.scrollWidth > window.innerWidth) out.push(`page: ${doc.scrollWidth} px wide in ${window.innerWidth}`);
    for (const el of document.querySelectorAll("body *")) {
        if (el.closest("svg") || el.offsetParent === null) continue;
        const cs = getComputedStyle(el);
        const clips = cs.overflowX !== "visible" || cs.textOverflow === "ellipsis";
        if (clips && el.scrollWidth > el.clientWidth + 1)
            out.push(`${el.tagName.toLowerCase()}#${el.id}.${el.className}: ${JSON.stringify(el.textContent.slice(0, 60))} needs ${el.scrollWidth} px, has ${el.clientWidth}`);
    }
    return out;
}"""
WIDTHS = (1280, 1440, 1920)


def test_dashboard_in_a_real_browser(traffic_node: NodeProcess) -> None:
    ns = Namespace("llama-3-8b", chunk_tokens=16)
    keys = chunk_keys(np.arange(16 * 12, dtype=np.int32), ns)
    with KVClient(traffic_node.unix) as kv:
        for i, key in enumerate(keys[:10]):  # 8 fit in 2 MiB: the first two are evicted
            assert kv.put(
                key, np.full(BLOCK, i, np.uint8), namespace=ns, parent=keys[i - 1] if i else None, token_count=16
            )
        assert kv.delete([keys[9]]) == 1
        kv.get_many(keys[:12])  # 7 hits; evicted 2, invalidated 1, never stored 2
        assert kv.match_prefix(keys[2:6]) == 4

    dash = Dashboard(
        StaticNodes([traffic_node.endpoints["metrics"].split("/")[2], "127.0.0.1:9"]), port=0, interval=0.25
    ).start()
    requests: list[str] = []
    errors: list[str] = []
    try:
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.on("request", lambda r: requests.append(r.url))
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.goto(dash.url)
                want = expected(traffic_node)
                assert (want["evicted"], want["invalidated"], want["never_stored"]) == (2, 1, 2)
                wait_for(lambda: matches(page, want), 15, f"the page to show {want}")
                # the unreachable node is down, the page carries on
                assert page.get_attribute('.node[data-node="127.0.0.1:9"]', "data-status") == "down"
                up_card = f'.node[data-node="{traffic_node.endpoints["metrics"].split("/")[2]}"]'
                assert page.get_attribute(up_card, "data-status") == "up"
                assert page.text_content(f"{up_card} .name") == traffic_node.node_id  # its id, not its address

                with KVClient(traffic_node.unix) as kv:  # more traffic: 6 hits, 1 more invalidated miss
                    kv.get_many(keys[2:9])
                newer = expected(traffic_node)
                assert (
                    newer["lookups"] == want["lookups"] + 7
                    and newer["invalidated"] == 1
                    and newer["ratio"] != want["ratio"]
                )
                wait_for(lambda: matches(page, newer), 15, f"the page to update to {newer}")
                wait_for(lambda: page.locator("#ratio-chart rect").count() > 0, 15, "the hit-ratio chart to draw")
                page.wait_for_timeout(600)  # let a couple more refreshes land before the picture
                (ROOT / "artifacts").mkdir(exist_ok=True)
                page.screenshot(path=str(ROOT / "artifacts" / "dashboard.png"), full_page=True)
                for width in WIDTHS:
                    page.set_viewport_size({"width": width, "height": 1000})
                    page.wait_for_timeout(700)  # a resize redraws, and a refresh lands
                    page.screenshot(path=str(ROOT / "artifacts" / f"dashboard-{width}.png"), full_page=True)
                    assert page.evaluate(CUT_OFF) == [], f"cut off at {width} px"
            finally:
                browser.close()
    finally:
        dash.close()
    assert not errors, errors
    outside = [u for u in requests if not u.startswith(dash.url)]
    assert not outside, f"the page fetched from outside the dashboard: {outside}"
    assert (ROOT / "artifacts" / "dashboard.png").stat().st_size > 20_000
    assert all((ROOT / "artifacts" / f"dashboard-{w}.png").stat().st_size > 20_000 for w in WIDTHS)
