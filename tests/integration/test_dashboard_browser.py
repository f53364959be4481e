"""The dashboard page in a real headless browser (Debian's ``chromium`` driven by Playwright):
it shows the same hit ratio and miss counts as the node's ``/metrics``, updates when more
traffic arrives, shows an unreachable node as down without breaking, titles nodes by their
id, and loads nothing from outside.  Screenshots at 1,280, 1,440 and 1,920 px are saved as
``artifacts/dashboard-<width>.png`` (and ``artifacts/dashboard.png``), and at each width no
text is cut off and nothing overflows the page.

The Engines panel (``--conductor``), against two real ``kvstore conductor`` processes side by
side over two stand-in engines (tests/stand_in_engine.py) and a conductor that is not there:
requests routed and prompt tokens per engine summed over both conductors, as the requests
sent say; running and queued while a request streams; each conductor's decision time and
prediction error as its ``/conductor/state`` says, and its rejections; a conductor that stops
keeps what it counted; an engine that dies is shown dead.  Screenshot:
``artifacts/dashboard-engines.png``.

Needs ``pip install playwright`` (its driver only: never ``playwright install``) and
``apt-get install chromium``; skipped, saying so, where either is missing.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, NodeProcess, wait_for
from test_conductor_front import Proc, completion, conductor, engine
from test_conductor_front import state as conductor_state

from client import KVClient, Namespace, chunk_keys
from kvstore.dashboard.scrape import fetch
from kvstore.dashboard.server import Dashboard, NoNodes, StaticNodes

pytestmark = pytest.mark.solo  # a real browser: scripts/test.sh runs it on its own

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
        first = kv.get_many(keys[:12])  # 7 hits; evicted 2, invalidated 1, never stored 2
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

                with KVClient(traffic_node.unix, agent="sglang-hicache") as kv:  # 6 hits, 1 more invalidated miss
                    later = kv.get_many(keys[2:9])
                    kv.report_skipped_saves(5, namespace=ns)  # an engine's save policy spared 5 chunks
                newer = expected(traffic_node)
                assert (
                    newer["lookups"] == want["lookups"] + 7
                    and newer["invalidated"] == 1
                    and newer["ratio"] != want["ratio"]
                )
                wait_for(lambda: matches(page, newer), 15, f"the page to update to {newer}")
                # the agents panel: the plain SDK's reads and writes apart from the named agent's
                agent = '#agents [data-agent="sglang-hicache"]'
                wait_for(lambda: page.locator(agent).count() == 1, 15, "the agent to show")
                reads = (page.get_attribute(agent, "data-reads"), page.get_attribute(agent, "data-read-hits"))
                found = sum(g is not None for g in later)
                assert reads == ("7", str(found))
                assert page.get_attribute(agent, "data-read-bytes") == str(found * BLOCK)
                sdk = '#agents [data-agent="sdk"]'
                reads = (page.get_attribute(sdk, "data-reads"), page.get_attribute(sdk, "data-read-hits"))
                assert reads == ("12", str(sum(g is not None for g in first)))
                assert page.get_attribute(sdk, "data-written") == "10"
                skipped = '#capacity-note [data-k="skipped_saves"]'
                wait_for(lambda: page.locator(skipped).count() == 1, 15, "the skipped saves to show")
                assert page.get_attribute(skipped, "data-value") == "5"
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


ENGINES_SHOWN = """() => {
    const out = {visible: !document.getElementById('engines-card').hidden, engines: {}, conductors: {}};
    const val = (el, k) => { const x = el.querySelector(`[data-k="${k}"]`); return x ? x.dataset.value : undefined; };
    for (const r of document.querySelectorAll('#engines .erow[data-engine]')) {
        const tokens = {};
        for (const x of r.querySelectorAll('[data-source]')) tokens[x.dataset.source] = parseFloat(x.dataset.value);
        out.engines[r.dataset.engine] = {status: r.dataset.status, routed: val(r, 'routed'), running: val(r, 'running'),
            queued: val(r, 'queued'), hit_ratio: val(r, 'hit_ratio'), hit_text: r.querySelector('[data-k="hit_ratio"]').textContent,
            tokens, view: r.querySelector('[data-k="staleness"]').textContent, err: (r.querySelector('.err') || {}).textContent || '',
            ttft: val(r, 'ttft'), ttft_predicted: r.querySelector('[data-k="ttft"]').dataset.predicted ?? null};
    }
    for (const c of document.querySelectorAll('#conductors [data-conductor]'))
        out.conductors[c.dataset.conductor] = {status: c.dataset.status, routed: val(c, 'routed'), rejected: val(c, 'rejected'),
            p50: val(c, 'decision_p50'), p99: val(c, 'decision_p99'), ttft_err: val(c, 'ttft_err'),
            err: (c.querySelector('.err') || {}).textContent || ''};
    return out;
}"""


def value(x: float | None) -> str:
    """A number as the page writes it into ``data-value`` (JavaScript's ``String``)."""
    return "" if x is None else str(int(x)) if x == int(x) else repr(float(x))


def test_engines_panel_against_real_conductors(tmp_path: Path) -> None:
    procs: list[Proc] = []
    dash: Dashboard | None = None
    errors: list[str] = []
    requests: list[str] = []
    try:
        a, b = engine(tmp_path, "a"), engine(tmp_path, "b")
        procs += [a, b]
        (tmp_path / "c1").mkdir()
        (tmp_path / "c2").mkdir()
        c1 = conductor(tmp_path / "c1", [a, b])
        procs.append(c1)
        # c2 refuses what the priors (2,000 tokens/s) say would take more than 2 s to a first token
        c2 = conductor(tmp_path / "c2", [a, b], "--slo-ttft-ms", "2000", "--min-samples", "0")
        procs.append(c2)
        assert completion(c2, n=8000)[0] == 429
        routed: collections.Counter[str] = collections.Counter()
        tokens: collections.Counter[str] = collections.Counter()
        for seed, (c, n) in enumerate(((c1, 64), (c1, 100), (c1, 32), (c2, 48), (c2, 80), (c2, 16))):
            status, body, headers = completion(c, n=n, seed=seed)
            assert status == 200, body
            routed[headers["x-kvstore-engine"]] += 1
            tokens[headers["x-kvstore-engine"]] += n
        ids = {p.url.removeprefix("http://") for p in (a, b)}
        names = {
            "c1": c1.url.removeprefix("http://"),
            "c2": c2.url,
            "gone": "127.0.0.1:9",
        }  # as given on the command line
        states = {k: conductor_state(c) for k, c in (("c1", c1), ("c2", c2))}
        assert sum(states["c2"]["routing"]["rejected"].values()) == 1

        def engines_match(page: Any) -> bool:
            got = page.evaluate(ENGINES_SHOWN)
            if not got["visible"] or set(got["engines"]) != ids:
                return False
            for eid, e in got["engines"].items():
                ratio = 0.0 if tokens[eid] else None  # no KV view, no pool: every prompt token is computed
                # predicted against measured TTFT: the conductor with most of the engine's first tokens
                seen = [t for st in states.values() if (t := st["routing"]["ttft_per_engine"].get(eid))]
                best = max(seen, key=lambda t: t["n"]) if seen else None
                want = {
                    "status": "up",
                    "routed": str(routed[eid]),
                    "running": "0",
                    "queued": "0",
                    "hit_ratio": value(ratio),
                    "hit_text": "0%" if ratio is not None else "—",
                    "tokens": {"compute": tokens[eid]} if tokens[eid] else {},
                    "view": "no KV events",
                    "ttft": value(best["measured_p50_ms"]) if best else "",
                    "ttft_predicted": value(best["predicted_p50_ms"]) if best else None,
                }
                if {k: e[k] for k in want} != want:
                    return False
            cs = got["conductors"]
            for k in ("c1", "c2"):
                r = states[k]["routing"]
                want_c = {
                    "status": "up",
                    "routed": str(sum(r["decisions_per_engine"].values())),
                    "rejected": str(sum(r["rejected"].values())),
                    "p50": value(r["decision_us"]["p50"]),
                    "p99": value(r["decision_us"]["p99"]),
                    "ttft_err": value(r["predicted_ttft_abs_err_median"]),
                }
                if {x: cs.get(names[k], {}).get(x) for x in want_c} != want_c:
                    return False
            return cs.get(names["gone"], {}).get("status") == "down" and "unreachable" in cs[names["gone"]]["err"]

        dash = Dashboard(NoNodes(), port=0, interval=0.25, conductors=list(names.values())).start()
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1440, "height": 1000})
                page.on("request", lambda r: requests.append(r.url))
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.goto(dash.url)
                # the sums equal what was sent through each conductor, and each conductor's own record
                assert sum(routed.values()) == sum(
                    sum(s["routing"]["decisions_per_engine"].values()) for s in states.values()
                )
                for eid in ids:
                    reported = [e["tokens"] for s in states.values() for e in s["engines"] if e["engine_id"] == eid]
                    assert sum(t.get("compute", 0) for t in reported) == tokens[eid]
                wait_for(lambda: engines_match(page), 20, "the Engines panel to show the conductors' figures")
                assert page.title() == "kvstore — 3 conductors"

                # a request streaming through c1: running on its engine while it decodes
                streamed: dict[str, Any] = {}
                t = threading.Thread(
                    target=lambda: streamed.update(r=completion(c1, n=24, seed=99, stream=True, max_tokens=1000))
                )
                t.start()
                wait_for(
                    lambda: any(
                        (e["running"], e["queued"]) == ("1", "0")
                        for e in page.evaluate(ENGINES_SHOWN)["engines"].values()
                    ),
                    10,
                    "a running request on the panel",
                )
                t.join(30)
                status, _, headers = streamed["r"]
                assert status == 200
                routed[headers["x-kvstore-engine"]] += 1
                tokens[headers["x-kvstore-engine"]] += 24
                states["c1"] = conductor_state(c1)
                wait_for(lambda: engines_match(page), 20, "the panel to count the streamed request")
                page.wait_for_timeout(600)
                (ROOT / "artifacts").mkdir(exist_ok=True)
                page.screenshot(path=str(ROOT / "artifacts" / "dashboard-engines.png"), full_page=True)
                for width in (1280, 1920):
                    page.set_viewport_size({"width": width, "height": 1000})
                    page.wait_for_timeout(500)
                    assert page.evaluate(CUT_OFF) == [], f"cut off at {width} px"

                # c2 stops: shown down, and what it routed still counts
                c2.stop()
                wait_for(
                    lambda: page.evaluate(ENGINES_SHOWN)["conductors"][names["c2"]]["status"] == "down",
                    15,
                    "the stopped conductor shown down",
                )
                shown_now = page.evaluate(ENGINES_SHOWN)
                assert {eid: e["routed"] for eid, e in shown_now["engines"].items()} == {
                    eid: str(routed[eid]) for eid in ids
                }
                assert all(e["status"] == "up" for e in shown_now["engines"].values())  # c1 still answers for them
                # an engine that dies: c1's probe takes it out, the panel says so and why
                b.kill()
                b_id = b.url.removeprefix("http://")
                wait_for(
                    lambda: page.evaluate(ENGINES_SHOWN)["engines"][b_id]["status"] == "down",
                    15,
                    "the dead engine shown dead",
                )
                assert page.evaluate(ENGINES_SHOWN)["engines"][b_id]["err"].startswith(names["c1"] + ": ")
            finally:
                browser.close()
    finally:
        if dash is not None:
            dash.close()
        for proc in reversed(procs):
            proc.stop()
    assert not errors, errors
    assert dash is not None
    outside = [u for u in requests if not u.startswith(dash.url)]
    assert not outside, f"the page fetched from outside the dashboard: {outside}"
