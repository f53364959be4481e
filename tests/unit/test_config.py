"""Node configuration: sizes, precedence (file → KVSTORE_* env → flags), unknown keys, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument
from kvstore.node.config import NodeConfig, default_data_dir, load_config, parse_size

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# -- sizes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4GiB", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("64MiB", 64 * MiB),
        ("64mib", 64 * MiB),
        (" 8 MiB ", 8 * MiB),
        ("1.5KiB", 1536),
        ("0.5GiB", GiB // 2),
        ("1.5G", 1_500_000_000),
        ("1k", 1000),
        ("2KB", 2000),
        ("3m", 3_000_000),
        ("1TiB", 1 << 40),
        ("65536", 65536),
        ("65536B", 65536),
        ("0", 0),
        (65536, 65536),
        (0, 0),
        ("9007199254740993", 9007199254740993),  # exact, no float rounding
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "-1", -1, "1e9", "4XB", "1.2.3", "GiB", "1.5", "0.3B", True, None, [1]])
def test_parse_size_rejects(bad: object) -> None:
    with pytest.raises(InvalidArgument) as ei:
        parse_size(bad)
    assert repr(bad) in str(ei.value) or str(bad) in str(ei.value)


# -- precedence ---------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "node.toml"
    p.write_text(text)
    return p


def test_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    cfg = load_config(environ={})
    assert cfg.dram == GiB and cfg.nvme == 4 * GiB
    assert cfg.listen == "127.0.0.1:50151" and cfg.max_batch == 4096
    assert cfg.drain_timeout_s == 10.0
    assert Path(cfg.data_dir) == tmp_path / "xdg" / "kvstore" == default_data_dir()
    assert cfg.socket_path() == tmp_path / "xdg" / "kvstore" / "kvstore.sock"
    assert cfg.arena_file().parent == Path("/dev/shm") and cfg.node_id in cfg.arena_file().name
    assert cfg.auth_token() == ""


def test_file_env_flags_precedence(tmp_path: Path) -> None:
    f = write(tmp_path, '[node]\nnode_id = "file"\ndram = "32MiB"\nmax_batch = 100\nread_lease_ttl_s = 11\nnvme = 0\n')
    env = {"KVSTORE_NODE_ID": "env", "KVSTORE_MAX_BATCH": "50", "KVSTORE_NVME": "1GiB"}
    cfg = load_config(f, environ=env, overrides={"node_id": "flag", "nvme": None, "read_lease_ttl_s": None})
    assert cfg.node_id == "flag"  # flag > env > file
    assert cfg.max_batch == 50  # env > file
    assert cfg.nvme == GiB  # env > file; a flag left unset (None) does not override
    assert cfg.dram == 32 * MiB and cfg.read_lease_ttl_s == 11.0  # file only
    assert load_config(f, environ={}).node_id == "file"


def test_file_may_be_flat(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, 'dram = "16MiB"\nwrite_through = true\n'), environ={})
    assert cfg.dram == 16 * MiB and cfg.write_through is True


def test_env_values_are_parsed(tmp_path: Path) -> None:
    env = {
        "KVSTORE_DRAM": "64MiB",
        "KVSTORE_WRITE_THROUGH": "true",
        "KVSTORE_DIRECT_IO": "0",
        "KVSTORE_READ_LEASE_TTL_S": "2.5",
        "KVSTORE_DRAIN_TIMEOUT_S": "0.5",
        "KVSTORE_DATA_DIR": str(tmp_path),
        "KVSTORE_TARGET": "ignored: it is the SDK's",
    }
    cfg = load_config(environ=env)
    assert cfg.dram == 64 * MiB and cfg.write_through is True and cfg.direct_io is False and cfg.read_lease_ttl_s == 2.5
    assert cfg.drain_timeout_s == 0.5
    assert Path(cfg.data_dir) == tmp_path


def test_token_file_wins_over_token(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.write_text("  from-file\n")
    assert load_config(environ={"KVSTORE_TOKEN": "inline"}).auth_token() == "inline"
    assert (
        load_config(environ={"KVSTORE_TOKEN": "inline"}, overrides={"token_file": str(tok)}).auth_token() == "from-file"
    )
    with pytest.raises(InvalidArgument, match="token_file"):
        load_config(environ={}, overrides={"token_file": str(tmp_path / "missing")}).auth_token()


# -- unknown keys and validation ----------------------------------------------------------


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="bogus_key") as ei:
        load_config(write(tmp_path, "[node]\nbogus_key = 1\n"), environ={})
    assert "dram" in str(ei.value)  # and the valid keys are listed


def test_unknown_section_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cluster"):
        load_config(write(tmp_path, "[node]\ndram = 1\n[cluster]\nx = 1\n"), environ={})


def test_unreadable_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read config file"):
        load_config(tmp_path / "missing.toml", environ={})
    with pytest.raises(InvalidArgument, match="cannot read config file"):
        load_config(write(tmp_path, "[node\n"), environ={})


def test_unknown_env_variable_is_named() -> None:
    with pytest.raises(InvalidArgument, match="KVSTORE_FOO") as ei:
        load_config(environ={"KVSTORE_FOO": "1"})
    assert "KVSTORE_DRAM" in str(ei.value)
    load_config(environ={"OTHER_FOO": "1"})  # other prefixes are not ours


def test_unknown_override_is_named() -> None:
    with pytest.raises(InvalidArgument, match="no_such_flag"):
        load_config(environ={}, overrides={"no_such_flag": 1})


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"dram": "lots"}, "dram: not a size: 'lots'"),
        ({"nvme": -1}, "nvme: size must be non-negative"),
        ({"max_block_bytes": "0"}, "max_block_bytes: Input should be greater than 0"),
        ({"read_lease_ttl_s": 0}, "read_lease_ttl_s: Input should be greater than 0 (got 0)"),
        ({"reservation_ttl_s": -1}, "reservation_ttl_s"),
        ({"drain_timeout_s": 0}, "drain_timeout_s: Input should be greater than 0 (got 0)"),
        ({"drain_timeout_s": "soon"}, "drain_timeout_s: Input should be a valid number"),
        ({"max_batch": "many"}, "max_batch: Input should be a valid integer"),
        ({"listen": "localhost"}, "listen: expected HOST:PORT, got 'localhost'"),
        ({"data_listen": "host:port"}, "data_listen: expected HOST:PORT"),
        ({"node_id": "../evil"}, "node_id must be letters"),
        ({"node_id": ""}, "node_id"),
        ({"write_through": "perhaps"}, "write_through"),
    ],
)
def test_validation_messages_name_the_field(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        load_config(environ={}, overrides=overrides)
    text = str(ei.value)
    assert text.startswith("invalid configuration: ") and message in text, text
    assert "errors.pydantic.dev" not in text


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(InvalidArgument) as ei:
        load_config(environ={"KVSTORE_MAX_BATCH": "0"}, overrides={"read_lease_ttl_s": -1})
    assert "max_batch" in str(ei.value) and "read_lease_ttl_s" in str(ei.value)


def test_config_is_frozen_and_strict() -> None:
    cfg = load_config(environ={})
    with pytest.raises(Exception, match="frozen"):
        cfg.dram = 5  # type: ignore[misc]
    with pytest.raises(Exception, match="extra"):
        NodeConfig(bogus=1)  # type: ignore[call-arg]
    assert cfg.model_copy(update={"dram": 5}).dram == 5 and cfg.dram == GiB


def test_derived_paths(tmp_path: Path) -> None:
    a = load_config(environ={}, overrides={"data_dir": str(tmp_path / "a"), "node_id": "n1"})
    b = load_config(environ={}, overrides={"data_dir": str(tmp_path / "b"), "node_id": "n1"})
    assert a.arena_file() != b.arena_file()  # one arena per data directory, even for the same node id
    assert (
        a.arena_file()
        == load_config(environ={}, overrides={"data_dir": str(tmp_path / "a"), "node_id": "n1"}).arena_file()
    )
    c = load_config(environ={}, overrides={"socket": "/run/kv.sock", "arena_path": "/dev/shm/x.arena"})
    assert c.socket_path() == Path("/run/kv.sock") and c.arena_file() == Path("/dev/shm/x.arena")
