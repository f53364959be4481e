"""Renamed settings keep their old spelling for one release (CHANGELOG.md, Unreleased).

``--lease-ttl`` (the etcd membership lease) is now ``--membership-ttl``; the read lease's
config key ``lease_ttl_s`` is now ``read_lease_ttl_s`` (flag ``--read-lease-ttl``) and
``etcd_lease_ttl_s`` is ``membership_ttl_s``.  The old spellings still set the same value and
warn; giving both spellings of one setting in one layer is an error.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvstore.cli import build_parser
from kvstore.errors import InvalidArgument
from kvstore.local import up
from kvstore.node.config import DEPRECATED_KEYS, NodeConfig, load_config


def test_new_keys_are_fields_and_old_ones_are_not() -> None:
    for old, new in DEPRECATED_KEYS.items():
        assert new in NodeConfig.model_fields and old not in NodeConfig.model_fields


def test_old_config_keys_set_the_new_fields_with_a_warning(tmp_path: Path) -> None:
    f = tmp_path / "kvstore.toml"
    f.write_text("[node]\nlease_ttl_s = 7\n")
    with pytest.warns(FutureWarning, match="lease_ttl_s is deprecated, use read_lease_ttl_s"):
        cfg = load_config(f, environ={})
    assert cfg.read_lease_ttl_s == 7.0 and cfg.lease_ttl_s == 7.0
    with pytest.warns(FutureWarning, match="KVSTORE_ETCD_LEASE_TTL_S is deprecated, use KVSTORE_MEMBERSHIP_TTL_S"):
        cfg = load_config(environ={"KVSTORE_ETCD_LEASE_TTL_S": "4"})
    assert cfg.membership_ttl_s == 4.0 and cfg.etcd_lease_ttl_s == 4.0
    with pytest.warns(FutureWarning, match="setting lease_ttl_s"):
        assert load_config(environ={}, overrides={"lease_ttl_s": 3}).read_lease_ttl_s == 3.0


def test_new_keys_need_no_warning_and_layers_keep_their_order(tmp_path: Path, recwarn: pytest.WarningsRecorder) -> None:
    f = tmp_path / "kvstore.toml"
    f.write_text("[node]\nread_lease_ttl_s = 7\nmembership_ttl_s = 5\n")
    cfg = load_config(f, environ={"KVSTORE_READ_LEASE_TTL_S": "8"}, overrides={"membership_ttl_s": 6})
    assert (cfg.read_lease_ttl_s, cfg.membership_ttl_s) == (8.0, 6.0)
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]
    # an old spelling in a later layer still overrides a new one in an earlier layer
    with pytest.warns(FutureWarning):
        assert load_config(f, environ={"KVSTORE_LEASE_TTL_S": "9"}).read_lease_ttl_s == 9.0


def test_both_spellings_in_one_layer_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="KVSTORE_LEASE_TTL_S and KVSTORE_READ_LEASE_TTL_S are one setting"):
        load_config(environ={"KVSTORE_LEASE_TTL_S": "1", "KVSTORE_READ_LEASE_TTL_S": "2"})
    f = tmp_path / "kvstore.toml"
    f.write_text("[node]\netcd_lease_ttl_s = 3\nmembership_ttl_s = 4\n")
    with pytest.raises(InvalidArgument, match="etcd_lease_ttl_s and membership_ttl_s are one setting"):
        load_config(f, environ={})


def test_serve_flags(capsys: pytest.CaptureFixture[str]) -> None:
    a = build_parser("serve").parse_args(["serve", "--membership-ttl", "12", "--read-lease-ttl", "5"])
    assert (a.membership_ttl_s, a.read_lease_ttl_s) == (12.0, 5.0)
    assert "deprecated" not in capsys.readouterr().err
    a = build_parser("serve").parse_args(["serve", "--lease-ttl", "13"])
    assert a.membership_ttl_s == 13.0
    assert "--lease-ttl is deprecated, use --membership-ttl" in capsys.readouterr().err


def test_up_flags(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="kvstore up")
    up.add_arguments(p)
    assert p.parse_args([]).membership_ttl == 10.0
    assert p.parse_args(["--membership-ttl", "3"]).membership_ttl == 3.0
    assert "deprecated" not in capsys.readouterr().err
    assert p.parse_args(["--lease-ttl", "4"]).membership_ttl == 4.0
    assert "kvstore up: warning: --lease-ttl is deprecated, use --membership-ttl" in capsys.readouterr().err
