"""Tenants: the config schema (TOML, env and flag forms, strict validation), token → caller
resolution, and the durable namespace-ownership table."""

from __future__ import annotations

import asyncio
import os
import re
import stat
from pathlib import Path

import pytest

from kvstore.cli import build_parser
from kvstore.errors import CapacityExceeded, InvalidArgument, PermissionDenied
from kvstore.node.config import NodeConfig, load_config
from kvstore.node.tenants import ADMIN, NO_NAMESPACE, Caller, Callers, Ownership

NS_A, NS_B, NS_C = b"A" * 8, b"B" * 8, b"C" * 8


def toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "node.toml"
    p.write_text(text)
    return p


def token_file(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


# -- config: the forms -------------------------------------------------------------------


def test_no_tenants_by_default() -> None:
    cfg = load_config(environ={})
    assert cfg.tenants == {} and cfg.tenant_tokens() == {}


def test_toml_tenants_beside_node(tmp_path: Path) -> None:
    alice = token_file(tmp_path, "alice.token", "  alice-secret\n")
    cfg = load_config(
        toml(
            tmp_path,
            f'''
[node]
token = "admin-secret"

[tenants.alice]
token_file = "{alice}"

[tenants.bob]
token = ["bob-1", "bob-2"]    # two tokens: rotation
''',
        ),
        environ={},
    )
    assert set(cfg.tenants) == {"alice", "bob"}
    assert cfg.tenants["bob"].token == ("bob-1", "bob-2")
    assert cfg.tenant_tokens() == {"alice-secret": "alice", "bob-1": "bob", "bob-2": "bob"}
    assert cfg.auth_token() == "admin-secret"


def test_toml_tenants_under_node_and_flat(tmp_path: Path) -> None:
    under = load_config(toml(tmp_path, '[node]\ndram = "8MiB"\n[node.tenants.alice]\ntoken = "a"\n'), environ={})
    flat = load_config(toml(tmp_path, 'dram = "8MiB"\n[tenants.alice]\ntoken = "a"\n'), environ={})
    assert under.tenant_tokens() == flat.tenant_tokens() == {"a": "alice"}


def test_tenants_given_twice_in_one_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="tenants twice"):
        load_config(toml(tmp_path, '[node.tenants.a]\ntoken = "x"\n[tenants.b]\ntoken = "y"\n'), environ={})


def test_env_and_flag_forms_name_token_files(tmp_path: Path) -> None:
    a1, a2, b = (token_file(tmp_path, n, n + "-tok") for n in ("a1", "a2", "b"))
    env = load_config(environ={"KVSTORE_TENANTS": f"alice={a1}, bob={b},alice={a2}"})
    assert env.tenant_tokens() == {"a1-tok": "alice", "a2-tok": "alice", "b-tok": "bob"}
    args = build_parser("serve").parse_args(["serve", "--tenant", f"alice={a1}", "--tenant", f"bob={b}"])
    assert args.tenants == [f"alice={a1}", f"bob={b}"]
    flags = load_config(environ={}, overrides={"tenants": args.tenants})
    assert flags.tenant_tokens() == {"a1-tok": "alice", "b-tok": "bob"}
    # later wins for the whole table, like every other key: flags replace the file's tenants
    merged = load_config(
        toml(tmp_path, '[tenants.carol]\ntoken = "c"\n'), environ={}, overrides={"tenants": args.tenants}
    )
    assert set(merged.tenants) == {"alice", "bob"}


@pytest.mark.parametrize("bad", ["alice", "=x", "alice=", "alice=/x,bob"])
def test_env_form_rejects_malformed_pairs(bad: str) -> None:
    with pytest.raises(InvalidArgument, match="tenants.*NAME=TOKEN_FILE"):
        load_config(environ={"KVSTORE_TENANTS": bad})


# -- config: strict validation -------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "-lead", "has space", "sl/ash", "x" * 65, "ünï"])
def test_bad_tenant_names(name: str) -> None:
    with pytest.raises(InvalidArgument, match="tenant names"):
        load_config(environ={}, overrides={"tenants": {name: {"token": "t"}}})


def test_empty_name_in_toml(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="tenant names"):
        load_config(toml(tmp_path, '[tenants.""]\ntoken = "t"\n'), environ={})


@pytest.mark.parametrize(
    "body,match",
    [
        ('bogus = 1\ntoken = "t"', "bogus"),  # unknown key
        ("", "token or token_file"),  # no credential
        ('token = ""', "empty token"),
        ('token = ["ok", "  "]', "empty token"),
        ('token_file = ""', "empty token"),
        ("token = 5", "token"),
    ],
)
def test_bad_tenant_tables(tmp_path: Path, body: str, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        load_config(toml(tmp_path, f"[tenants.alice]\n{body}\n"), environ={})


def test_tenants_must_be_a_table(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="tenants"):
        load_config(toml(tmp_path, "tenants = 3\n"), environ={})


def test_a_token_names_one_tenant(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="share a token"):
        load_config(toml(tmp_path, '[tenants.a]\ntoken = "same"\n[tenants.b]\ntoken = " same "\n'), environ={})
    # in files it is found when the node reads them (start-up)
    f1, f2 = token_file(tmp_path, "f1", "dup\n"), token_file(tmp_path, "f2", "dup")
    cfg = load_config(
        toml(tmp_path, f'[tenants.a]\ntoken_file = "{f1}"\n[tenants.b]\ntoken_file = "{f2}"\n'), environ={}
    )
    with pytest.raises(InvalidArgument, match="share a token"):
        cfg.tenant_tokens()


def test_a_tenant_cannot_hold_the_admin_token(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="admin token"):
        load_config(toml(tmp_path, '[node]\ntoken = "root"\n[tenants.a]\ntoken = "root"\n'), environ={})
    admin = token_file(tmp_path, "admin", "root\n")
    cfg = load_config(toml(tmp_path, f'[node]\ntoken_file = "{admin}"\n[tenants.a]\ntoken = "root"\n'), environ={})
    with pytest.raises(InvalidArgument, match="admin token"):
        cfg.tenant_tokens()


def test_unreadable_or_empty_token_files(tmp_path: Path) -> None:
    cfg = NodeConfig(tenants={"a": {"token_file": str(tmp_path / "missing")}})
    with pytest.raises(InvalidArgument, match="cannot read token_file .* of tenant 'a'"):
        cfg.tenant_tokens()
    cfg = NodeConfig(tenants={"a": {"token_file": token_file(tmp_path, "blank", " \n")}})
    with pytest.raises(InvalidArgument, match="is empty"):
        cfg.tenant_tokens()


def test_metrics_with_tenants_need_the_admin_token() -> None:
    with pytest.raises(InvalidArgument, match="metrics_port with tenants needs the admin token"):
        load_config(environ={}, overrides={"tenants": {"a": {"token": "t"}}, "metrics_port": 0})
    NodeConfig(tenants={"a": {"token": "t"}}, metrics_port=0, token="admin")
    NodeConfig(metrics_port=0)  # no tenants: as before


def test_tokens_do_not_show_in_repr() -> None:
    cfg = NodeConfig(tenants={"a": {"token": "very-secret"}})
    assert "very-secret" not in repr(cfg)


# -- callers ----------------------------------------------------------------------------------


def test_callers_resolve_headers() -> None:
    c = Callers("root", {"ta": "alice", "tb": "bob"})
    assert c.identify("Bearer root") == ADMIN
    assert c.identify("Bearer ta") == Caller("alice")
    assert c.identify(b"Bearer tb") == Caller("bob")
    for bad in ("", "ta", "Bearer ", "Bearer TA", "Bearer ta ", "bearer ta"):
        assert c.identify(bad) is None
    assert c.tenants == {"alice", "bob"}
    assert Callers("", {"ta": "alice"}).identify("Bearer ") is None  # no admin token: no admin


# -- ownership --------------------------------------------------------------------------------


def test_first_writer_owns_and_it_survives_reopening(tmp_path: Path) -> None:
    alice, bob = Caller("alice"), Caller("bob")

    async def main() -> None:
        o = Ownership(tmp_path / "owners.lmdb")
        await o.claim(alice, {NS_A})
        await o.claim(alice, {NS_A})  # again: nothing new
        await o.claim(bob, {NS_B})
        with pytest.raises(PermissionDenied, match="another tenant"):
            await o.claim(bob, {NS_A})
        with pytest.raises(PermissionDenied):  # all or nothing: NS_C is not claimed either
            await o.claim(bob, {NS_A, NS_C})
        assert o.owner(NS_C) is None
        await o.claim(ADMIN, {NS_C})  # the admin claims nothing
        assert o.owner(NS_C) is None
        with pytest.raises(PermissionDenied, match="with a namespace"):
            await o.claim(alice, {NO_NAMESPACE})
        assert o.may_modify(alice, NS_A) and not o.may_modify(bob, NS_A) and o.may_modify(ADMIN, NS_A)
        assert not o.may_modify(alice, NS_C)  # nobody's: only the admin changes it
        o.close()

    asyncio.run(main())
    o = Ownership(tmp_path / "owners.lmdb")
    try:
        assert (o.owner(NS_A), o.owner(NS_B), o.owner(NS_C), len(o)) == ("alice", "bob", None, 2)
    finally:
        o.close()


def test_claims_per_tenant_are_bounded(tmp_path: Path) -> None:
    async def main() -> None:
        o = Ownership(tmp_path / "owners.lmdb", max_per_tenant=2)
        await o.claim(Caller("a"), {NS_A, NS_B})
        with pytest.raises(CapacityExceeded, match="limit is 2"):
            await o.claim(Caller("a"), {NS_C})
        await o.claim(Caller("b"), {NS_C})  # another tenant is not held back
        o.close()

    asyncio.run(main())


def test_concurrent_claims_one_winner(tmp_path: Path) -> None:
    async def main() -> None:
        o = Ownership(tmp_path / "owners.lmdb")
        results = await asyncio.gather(*(o.claim(Caller(f"t{i}"), {NS_A}) for i in range(8)), return_exceptions=True)
        winners = [i for i, r in enumerate(results) if r is None]
        assert len(winners) == 1 and o.owner(NS_A) == f"t{winners[0]}"
        assert all(isinstance(r, PermissionDenied) for r in results if r is not None)
        o.close()

    asyncio.run(main())


def test_ownership_table_was_world_readable(tmp_path: Path) -> None:
    """``owners.lmdb`` was created 0644; now 0600, like the NVMe segments."""
    old = os.umask(0o022)
    try:
        o = Ownership(tmp_path / "owners.lmdb")
    finally:
        os.umask(old)
    try:
        for name in ("data.mdb", "lock.mdb"):
            assert stat.S_IMODE((tmp_path / "owners.lmdb" / name).stat().st_mode) == 0o600, name
    finally:
        o.close()


# -- config: per-tenant limits on what eviction cannot reclaim ---------------------------------


def test_tenant_limits_parse_sizes_and_default_to_none(tmp_path: Path) -> None:
    cfg = load_config(
        toml(
            tmp_path,
            '[node]\nmax_pin_ttl_s = 600\n\n[tenants.alice]\ntoken = "a"\n\n'
            '[tenants.bob]\ntoken = "b"\nmax_reserved_bytes = "512MiB"\nmax_pinned_bytes = 65536\n',
        ),
        environ={},
    )
    assert cfg.max_pin_ttl_s == 600
    assert (cfg.tenants["alice"].max_reserved_bytes, cfg.tenants["alice"].max_pinned_bytes) == (None, None)
    assert (cfg.tenants["bob"].max_reserved_bytes, cfg.tenants["bob"].max_pinned_bytes) == (512 << 20, 65536)
    assert load_config(environ={}).max_pin_ttl_s == 3600


@pytest.mark.parametrize(
    "line, message",
    [
        ('max_pinned_bytes = "lots"', "tenants.bob.max_pinned_bytes: not a size: 'lots'"),
        ('max_reserved_bytes = "1.5"', "tenants.bob.max_reserved_bytes: not a whole number of bytes"),
        ("max_reserved_bytes = -1", "tenants.bob.max_reserved_bytes: size must be non-negative"),
        ("max_reserved_bytes = true", "tenants.bob.max_reserved_bytes: not a size: True"),
        (
            "max_pin_ttl_s = 60",
            "tenants.bob.max_pin_ttl_s: Extra inputs are not permitted",
        ),  # node-wide, not per tenant
    ],
)
def test_bad_tenant_limits_are_clear_errors(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        load_config(toml(tmp_path, f'[tenants.bob]\ntoken = "b"\n{line}\n'), environ={})


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-5", "soon"])
def test_max_pin_ttl_must_be_finite_and_positive(value: str) -> None:
    with pytest.raises(InvalidArgument, match="max_pin_ttl_s"):
        load_config(environ={"KVSTORE_MAX_PIN_TTL_S": value})


def test_max_pin_ttl_flag() -> None:
    a = build_parser().parse_args(["serve", "--max-pin-ttl", "90"])
    assert a.max_pin_ttl_s == 90.0
