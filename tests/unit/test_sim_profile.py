"""Engine profiles: the bundled files load, cite every constant, and bad files are refused by key."""

from __future__ import annotations

import json
import math
import random
import tomllib
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.sim.profile import CONSTANTS, EngineProfile, list_profiles

ROOT = Path(__file__).resolve().parents[2]
PROFILES = ROOT / "kvstore" / "sim" / "profiles"


def _raw(name: str) -> dict[str, object]:
    obj = json.loads((PROFILES / f"{name}.json").read_text(encoding="utf-8"))
    assert isinstance(obj, dict)
    return obj


def _write(tmp_path: Path, obj: dict[str, object]) -> Path:
    p = tmp_path / "p.json"
    p.write_text(json.dumps(obj), encoding="utf-8")
    return p


def test_the_bundled_profiles_load_by_name() -> None:
    names = list_profiles()
    assert {"local", "h100-llama3-8b"} <= set(names)
    assert names == sorted(p.stem for p in PROFILES.glob("*.json"))
    for n in names:
        p = EngineProfile.load(n)
        assert p.name == n and p.model and p.hardware and p.description


def test_every_constant_of_every_bundled_profile_is_cited() -> None:
    for n in list_profiles():
        p = EngineProfile.load(n)
        assert p.uncited() == [], f"{n}: no source for {p.uncited()}"
        assert set(p.sources) == set(CONSTANTS)


def test_the_local_profile_says_where_its_step_figures_come_from() -> None:
    p = EngineProfile.load("local")
    from kvstore.sim.calibrate import COLUMNS  # every constant the calibration fits

    assert "request_ms" in COLUMNS and "prefill_cached_attn_ms" in COLUMNS
    for k in COLUMNS:
        assert "kvstore sim calibrate" in p.sources[k] and "OpenAI server" in p.sources[k], k
    for k in ("connector_step_ms", "connector_request_ms"):
        assert "kvstore sim validate --fit-connector" in p.sources[k] and "kvstore bench serving" in p.sources[k], k
    # the bench's model: 4 layers x (K, V) x 2 KV heads x 128 x float32; 64 MiB of blocks of 128
    # tokens, less vLLM's null block
    assert p.kv_bytes_per_token == 4 * 2 * 2 * 128 * 4
    assert p.num_gpu_blocks == (64 << 20) // (p.kv_bytes_per_token * p.block_size) - 1
    # the served calibration's medians (docs/sim.md): one short sequence decoding, 13.3 ms a step;
    # fresh prompts of 32, 512 and 2,048 tokens, 21.9, 138.8 and 651.1 ms to the first token, each
    # one request taken in (request_ms: what a decode step does not pay)
    assert p.step_ms(0, 0, 1, 40) == pytest.approx(13.3, rel=0.1)
    assert p.step_ms(32, 32 * 32, 0, 0, 0, 1) == pytest.approx(21.9, rel=0.1)
    assert p.step_ms(512, 512 * 512, 0, 0, 0, 1) == pytest.approx(138.8, rel=0.1)
    assert p.step_ms(2048, 2048 * 2048, 0, 0, 0, 1) == pytest.approx(651.1, rel=0.1)
    assert p.request_ms > 2.0 and p.jitter_cv == pytest.approx(0.1725)  # measured; seeded (--seed): deterministic
    # a prefill over a cached prefix: its new tokens' pairs with the prefix, priced apart, two to three
    # times a pair among new tokens (the served calibration's 27 such steps)
    assert 1.5 < p.prefill_cached_attn_ms / p.prefill_attn_ms < 3.0  # type: ignore[operator]
    assert p.step_ms(384, 384 * (1024 + 384), 0, 0, 384 * 1024) > p.step_ms(384, 384 * (1024 + 384), 0, 0)


def test_the_h100_profile_is_the_published_figures() -> None:
    p = EngineProfile.load("h100-llama3-8b")
    assert p.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert p.num_gpu_blocks == math.floor(60e9 / (131072 * 16))
    assert (p.block_size, p.max_num_batched_tokens) == (16, 8192)
    for t in (128, 1000, 8192):  # Dynamo's polynomial, its 16.5 ms constant replaced by the step overhead
        assert p.step_ms(t, t * t, 0, 0) == pytest.approx(4.21e-7 * t * t + 1.52e-2 * t + p.overhead_ms)
    assert p.step_ms(0, 0, 1, 1000) == pytest.approx(12, abs=0.1)  # llm-d's ITL
    assert "derived" in p.sources["kv_bytes_per_token"] and "Mooncake" in p.sources["network_bandwidth_Bps"]


def test_an_unknown_key_is_refused_by_name(tmp_path: Path) -> None:
    obj = _raw("local")
    obj["overhed_ms"] = 3.0
    with pytest.raises(ValueError, match="unknown key 'overhed_ms'"):
        EngineProfile.load(_write(tmp_path, obj))


def test_missing_and_out_of_range_values_are_refused_by_name(tmp_path: Path) -> None:
    obj = _raw("local")
    del obj["block_size"]
    with pytest.raises(InvalidArgument, match="missing key.*'block_size'"):
        EngineProfile.load(_write(tmp_path, obj))
    for key, bad, what in [
        ("block_size", 0, "positive integer"),
        ("max_num_seqs", 2.5, "positive integer"),
        ("num_gpu_blocks", True, "positive integer"),
        ("overhead_ms", 0, "positive"),
        ("nvme_bandwidth_Bps", -1.0, "positive"),
        ("prefill_attn_ms", -1e-9, "not be negative"),
        ("jitter_cv", "0.1", "finite number"),
    ]:
        obj = _raw("local")
        obj[key] = bad
        with pytest.raises(ValueError, match=f"'{key}' must .*{what}"):
            EngineProfile.load(_write(tmp_path, obj))
    obj = _raw("local")
    obj["sources"] = {"overhead": "a paper"}
    with pytest.raises(InvalidArgument, match=r"sources\['overhead'\] names no constant"):
        EngineProfile.load(_write(tmp_path, obj))


def test_optional_fields_default(tmp_path: Path) -> None:
    obj = _raw("h100-llama3-8b")
    del obj["jitter_cv"], obj["sources"]
    p = EngineProfile.load(_write(tmp_path, obj))
    assert p.jitter_cv == 0.0 and "jitter_cv" in p.uncited() and len(p.uncited()) == len(CONSTANTS)
    del obj["prefill_cached_attn_ms"], obj["connector_save_ms"]
    q = EngineProfile.load(_write(tmp_path, obj))
    assert q.prefill_cached_attn_ms == q.prefill_attn_ms and q.connector_save_ms == 0.0  # the earlier model
    assert q.step_ms(100, 100 * 300, 0, 0, 100 * 200) == q.step_ms(100, 100 * 300, 0, 0)


def test_a_saved_profile_loads_back_equal(tmp_path: Path) -> None:
    p = EngineProfile.load("h100-llama3-8b")
    p.save(tmp_path / "copy.json")
    q = EngineProfile.load(tmp_path / "copy.json")
    assert q == p and q.to_dict() == p.to_dict() == _raw("h100-llama3-8b")


def test_an_unknown_name_lists_the_bundled_ones(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="no bundled profile 'a100'.*h100-llama3-8b.*local"):
        EngineProfile.load("a100")
    with pytest.raises(InvalidArgument, match="cannot read profile"):
        EngineProfile.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        EngineProfile.load(tmp_path / "bad.json")


def test_a_load_costs_latency_plus_bytes_over_bandwidth() -> None:
    p = EngineProfile.load("h100-llama3-8b")
    assert p.load_s("nvme", 7_000_000_000) == pytest.approx(p.nvme_latency_s + 1.0)
    assert p.load_s("dram", 0) == 0.0
    with pytest.raises(InvalidArgument, match="unknown tier 'hbm'"):
        p.load_s("hbm", 1)  # type: ignore[arg-type]


def test_jitter_is_lognormal_with_mean_1_and_the_profiles_cv() -> None:
    p = EngineProfile(**{**EngineProfile.load("local").to_dict(), "jitter_cv": 0.25})
    rng = random.Random(3)
    xs = [p.jitter(rng) for _ in range(20000)]
    mean = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))
    assert mean == pytest.approx(1.0, abs=0.01) and sd / mean == pytest.approx(0.25, abs=0.01)
    assert min(xs) > 0
    assert EngineProfile.load("h100-llama3-8b").jitter(rng) == 1.0  # a cv of 0: no jitter


def test_the_profiles_ship_as_package_data() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = cfg["tool"]["setuptools"]["package-data"]["kvstore.sim"]
    shipped = {p for g in globs for p in (ROOT / "kvstore" / "sim").glob(g)}
    assert set(PROFILES.glob("*.json")) <= shipped


def test_a_profile_is_a_value() -> None:
    p = EngineProfile.load("local")
    assert hash(p) == hash(EngineProfile.load("local")) and {p: 1}[EngineProfile.load("local")] == 1
    with pytest.raises(TypeError):
        p.sources["overhead_ms"] = "changed"  # type: ignore[index]
