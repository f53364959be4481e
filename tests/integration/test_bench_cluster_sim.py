"""``kvstore bench cluster-sim``: every figure of issue 19 per cluster size, as JSON on stdout
(the table on stderr), with membership against a private etcd when one is installed."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT

from kvstore.cluster.local_etcd import find_etcd


def bench(*args: str) -> tuple[dict, str]:
    r = subprocess.run(
        [sys.executable, "-m", "kvstore", "bench", "cluster-sim", "--quick", "--json", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


def test_cluster_sim_reports_every_figure_per_size() -> None:
    out, table = bench("--nodes", "3,64", "--no-membership")
    assert [m["nodes"] for m in out["results"]] == [3, 64]
    for m in out["results"]:
        assert m["us_per_key"]["bounded"] > 0 and m["match_prefix_1000_ms"]["bounded"] > 0
        assert {"join", "leave", "ideal_join", "ideal_leave"} <= set(m["moved"]["r2"])
        assert max(m["balance"].values()) <= 1.06
        assert m["rpcs"]["chunks=1000,group=64"]["read_rpcs"] <= 16
        assert m["hot"]["with"]["max_over_mean"] <= m["hot"]["without"]["max_over_mean"]
    assert out["results"][1]["hot"]["with"]["max_over_mean"] <= 2.0
    assert "skipped" in out["membership"] and "membership:" in table


def test_cluster_sim_measures_membership_on_a_real_etcd_or_says_why_not() -> None:
    out, table = bench("--nodes", "100")
    mem = out["membership"]
    if find_etcd() is None:
        assert "not installed" in mem["skipped"] and "not measured" in table
        return
    assert mem["nodes"] == 100 and mem["full_reads"]["per_view"] == 1
    assert mem["join_leave_max_ms"] > 0 and mem["keepalive"]["rpcs_per_node_s"] > 0
    assert "keep-alive on etcd per node" in table
