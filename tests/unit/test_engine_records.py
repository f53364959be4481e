"""Engine records in etcd (``engines/<engine_id>``, for a request scheduler): the record's
JSON, the watcher ignoring records it cannot trust, the connector settings that turn
registration on, and the record the connector builds (no vLLM, no etcd: pure parts)."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest

from gpu_agent.vllm.registry import engine_record, engine_role, reachable_endpoint, served_models
from gpu_agent.vllm.settings import ConnectorSettings
from gpu_agent.vllm.spec import EngineSpec, request_namespace
from kvstore.cluster.etcd import _Builder
from kvstore.cluster.state import ClusterSnapshot, EngineRecord, engine_key, node_key
from kvstore.errors import InvalidArgument
from kvstore.keys import Namespace

CLUSTER = "eng"
REC = EngineRecord(
    engine_id="10.0.0.5:8000",
    url="http://10.0.0.5:8000",
    role="prefill",
    fingerprint="0123456789abcdef",
    chunk_tokens=256,
    block_size=16,
    models=("llama", "llama-alias"),
    node="unix:///run/kvstore.sock",
    kv_events="tcp://10.0.0.5:5557",
    kv_events_replay="tcp://10.0.0.5:5558",
    tp_size=2,
    bytes_per_token=4096,
    host="gpu-5",
    pid=4242,
    started_at=1700000000.5,
)


def raw(**change: Any) -> bytes:
    d = json.loads(REC.to_json())
    for k, v in change.items():
        if v is ...:
            d.pop(k)
        else:
            d[k] = v
    return json.dumps(d).encode()


def test_an_engine_record_round_trips_through_json() -> None:
    assert EngineRecord.from_json(REC.to_json()) == REC
    assert json.loads(REC.to_json())["models"] == ["llama", "llama-alias"]  # a JSON list, a tuple again
    assert EngineRecord.from_json(raw(newer_field={"x": 1})) == REC  # newer engines may add fields
    assert REC.namespace_fingerprint == bytes.fromhex("0123456789abcdef")
    assert engine_key(CLUSTER, REC.engine_id) == b"/kvstore/eng/engines/10.0.0.5:8000"
    assert engine_key(CLUSTER, "a").rsplit(b"/", 2)[0] == node_key(CLUSTER, "a").rsplit(b"/", 2)[0]


@pytest.mark.parametrize(
    "change",
    [
        {"url": ...},  # a required field missing
        {"fingerprint": ...},
        {"chunk_tokens": "256"},  # wrong types
        {"block_size": 16.0},
        {"models": "llama"},
        {"models": [1]},
        {"pid": True},
        {"started_at": "now"},
        {"kv_events": None},
        {"role": "both-ish"},  # values no engine has
        {"fingerprint": "0123"},
        {"chunk_tokens": 250},  # not whole vLLM blocks
        {"tp_size": 0},
        {"url": "10.0.0.5:8000"},
        {"engine_id": "a/b"},
    ],
)
def test_records_that_do_not_parse_or_validate_are_ignored_by_the_watcher(change: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        EngineRecord.from_json(raw(**change))
    b = _Builder(CLUSTER)
    b.apply(engine_key(CLUSTER, "good"), raw(engine_id="good"), 1)
    b.apply(engine_key(CLUSTER, REC.engine_id), raw(**change), 2)
    snap = b.freeze(connected=True)
    assert set(snap.engines) == {"good"} and snap.revision == 2


def test_the_watcher_follows_engines_and_ignores_records_claiming_another_id() -> None:
    b = _Builder(CLUSTER)
    b.apply(engine_key(CLUSTER, REC.engine_id), REC.to_json(), 1, lease=7)
    b.apply(engine_key(CLUSTER, "other"), REC.to_json(), 2)  # says it is 10.0.0.5:8000
    b.apply(b"/kvstore/eng/engines/list", b"[1, 2]", 3)
    b.apply(b"/kvstore/eng/engines/junk", b"{not json", 4)
    snap = b.freeze(connected=True)
    assert snap.engines == {REC.engine_id: REC} and snap.nodes == {}
    assert snap.to_dict()["engines"][REC.engine_id]["url"] == REC.url
    b.apply(engine_key(CLUSTER, REC.engine_id), b"garbage", 5)  # garbled later: the last good one stays
    assert b.freeze(connected=True).engines == {REC.engine_id: REC}
    b.apply(engine_key(CLUSTER, REC.engine_id), None, 6)  # its lease expired
    assert b.freeze(connected=True).engines == {}
    assert ClusterSnapshot(CLUSTER).engines == {}


def test_engine_ids_are_checked() -> None:
    for good in ("engine-1", "10.0.0.5:8000", "[::1]:8000", "gpu.example.com:8000"):
        assert dataclasses.replace(REC, engine_id=good).engine_id == good
    for bad in ("", "a/b", ":8000", "-x", "a b", "x" * 300):
        with pytest.raises(InvalidArgument, match="engine id"):
            engine_key(CLUSTER, bad)


# -- the connector's settings ------------------------------------------------------------------------------
def test_advertise_url_without_an_etcd_to_register_in_fails_naming_both_keys() -> None:
    with pytest.raises(InvalidArgument, match="advertise_url.*registry"):
        ConnectorSettings.from_extra({"advertise_url": "http://10.0.0.5:8000", "target": "unix:///x"})
    with pytest.raises(InvalidArgument, match="advertise_url.*registry"):
        ConnectorSettings.from_extra({"advertise_url": "http://10.0.0.5:8000", "lookup_target": "10.0.0.1:7070"})


def test_the_registry_defaults_to_an_etcd_lookup_target_and_the_id_to_host_port() -> None:
    s = ConnectorSettings.from_extra({"advertise_url": "http://10.0.0.5:8000", "lookup_target": "etcd://e1:2379/prod"})
    assert (s.registry_target(), s.registered_engine_id()) == ("etcd://e1:2379/prod", "10.0.0.5:8000")
    s = ConnectorSettings.from_extra({"advertise_url": "https://gpu5.example.com", "target": "etcd://e1:2379/prod"})
    assert (s.registry_target(), s.registered_engine_id()) == ("etcd://e1:2379/prod", "gpu5.example.com:443")
    s = ConnectorSettings.from_extra(
        {
            "advertise_url": "http://[fd00::5]:8000",
            "lookup_target": "etcd://e1:2379/prod",
            "registry": "etcd://e2:2379/other",
            "engine_id": "gpu5-a",
        }
    )
    assert (s.registry_target(), s.registered_engine_id()) == ("etcd://e2:2379/other", "gpu5-a")
    assert ConnectorSettings().registry_target() == "" and ConnectorSettings().registered_engine_id() == ""


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"advertise_url": "10.0.0.5:8000"}, "advertise_url must be http"),
        ({"advertise_url": "http://0.0.0.0:8000"}, "wildcard"),
        ({"advertise_url": "http://h:99999"}, "advertise_url must be http"),
        ({"advertise_url": "http://h:8000", "registry": "e1:2379"}, "registry"),
        ({"advertise_url": "http://h:8000", "registry": "etcd://e1:2379/c", "engine_id": "a/b"}, "engine_id"),
        ({"registry": "etcd://e1:2379/c"}, "advertise_url"),
        ({"engine_id": "x"}, "advertise_url"),
    ],
)
def test_bad_registration_settings_fail_at_start_naming_the_key(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        ConnectorSettings.from_extra(extra)


# -- the record the connector builds ------------------------------------------------------------------------
def test_roles_models_and_reachable_kv_event_endpoints() -> None:
    assert [engine_role(r) for r in ("kv_producer", "kv_consumer", "kv_both", None)] == [
        "prefill",
        "decode",
        "both",
        "both",
    ]
    assert served_models("m", "/models/m") == ("m",) and served_models(["a", "b", "a"], "x") == ("a", "b")
    assert served_models(None, "/models/m") == ("/models/m",) and served_models([], "x") == ("x",)
    assert reachable_endpoint("tcp://*:5557", "10.0.0.5") == "tcp://10.0.0.5:5557"
    assert reachable_endpoint("tcp://0.0.0.0:5558", "10.0.0.5") == "tcp://10.0.0.5:5558"
    assert reachable_endpoint("tcp://[::]:5557", "[fd00::5]") == "tcp://[fd00::5]:5557"
    assert reachable_endpoint("tcp://10.0.0.9:5557", "10.0.0.5") == "tcp://10.0.0.9:5557"  # a replay socket binds it
    # vLLM's publisher given a host connects out to a subscriber there: nothing to subscribe to
    assert reachable_endpoint("tcp://10.0.0.9:5557", "10.0.0.5", publisher=True) == ""
    assert reachable_endpoint("tcp://*:5557", "10.0.0.5", publisher=True) == "tcp://10.0.0.5:5557"
    assert reachable_endpoint("tcp://*:0", "10.0.0.5") == ""  # the OS picks the port: unknown here
    assert reachable_endpoint("inproc://events", "10.0.0.5") == ""
    assert reachable_endpoint("ipc:///tmp/ev", "10.0.0.5") == "ipc:///tmp/ev"
    assert reachable_endpoint(None, "10.0.0.5") == ""


def test_the_record_carries_the_fingerprint_the_connector_keys_plain_requests_by() -> None:
    spec = EngineSpec("m", "main", "float16", 2, 2, 64, 16, "vllm:cpu:NHD", tp_size=2)
    settings = ConnectorSettings.from_extra(
        {"advertise_url": "http://10.0.0.5:8000/", "lookup_target": "etcd://e1:2379/c", "salt": "deploy"}
    )
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=1, data_parallel_index=0),
        model_config=SimpleNamespace(served_model_name="m-served", model="/models/m"),
        kv_transfer_config=SimpleNamespace(kv_role="kv_consumer"),
        kv_events_config=None,
    )
    rec = engine_record(cfg, spec, settings, 256)
    plain = SimpleNamespace(lora_request=None, cache_salt=None)
    ns = request_namespace(spec, settings, 256, plain)  # what the scheduler half keys a plain request by
    assert rec.fingerprint == ns.fingerprint.hex()
    assert Namespace.from_dict(ns.to_dict()).fingerprint == rec.namespace_fingerprint  # as kv_transfer_params say
    assert (rec.engine_id, rec.url, rec.role, rec.models) == (
        "10.0.0.5:8000",
        "http://10.0.0.5:8000",
        "decode",
        ("m-served",),
    )
    assert (rec.chunk_tokens, rec.block_size, rec.tp_size, rec.kv_events) == (256, 16, 2, "")
    assert rec.bytes_per_token == 2 * 2 * 2 * 64 * 2 * 2  # layers x K,V x heads x dim x fp16, both ranks
    assert EngineRecord.from_json(rec.to_json()) == rec
    dp = SimpleNamespace(
        **{**vars(cfg), "parallel_config": SimpleNamespace(data_parallel_size=2, data_parallel_index=1)}
    )
    assert engine_record(dp, spec, settings, 256).engine_id == "10.0.0.5:8000-dp1"
