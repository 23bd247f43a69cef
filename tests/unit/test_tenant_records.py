"""Signed tenant records (gateway/tenancy/records.py), key digests (gateway/tenancy/keys.py) and the
auth section of the config: what is trusted, what is refused and why."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli.main import main
from gateway.config import ConfigError, parse_config
from gateway.tenancy.keys import Keyring
from gateway.tenancy.records import Record, RecordError, dump, load, tombstone
from routing.types import TenantClass

SECRET = "s" * 40
KEYRING = Keyring(SECRET)
RECORD = Record("web", KEYRING.digest("k" * 40), TenantClass.STANDARD, "acme", 1_700_000_000.5)
POOLS = [{"name": "p", "replicas": ["http://127.0.0.1:1"]}]
KEY = "k" * 32
KEY_SHA256 = hashlib.sha256(KEY.encode()).hexdigest()


def test_a_record_and_a_tombstone_round_trip() -> None:
    assert load("web", dump(RECORD, KEYRING), KEYRING) == RECORD
    gone = tombstone("web", 1_700_000_001.0)
    assert load("web", dump(gone, KEYRING), KEYRING) == gone


def _tampered(**change: Any) -> str:
    d = json.loads(dump(RECORD, KEYRING))
    d.update(change)
    return json.dumps(d)


@pytest.mark.parametrize(
    ("name", "value", "reason"),
    [
        ("web", "not json", "malformed"),
        ("web", "[1, 2]", "malformed"),
        ("web", "null", "malformed"),
        ("web", _tampered(v=2), "malformed"),
        ("web", _tampered(at="soon"), "malformed"),
        ("web", _tampered(at=True), "malformed"),
        ("web", _tampered(digest=5), "malformed"),
        ("web", _tampered(digest="ab"), "malformed"),
        ("web", _tampered(deleted="yes"), "malformed"),
        ("web", _tampered(share_group=["a"]), "malformed"),
        ("web", _tampered(**{"class": "royalty"}), "malformed"),
        ("web", _tampered(sig=None), "unsigned"),
        ("web", _tampered(sig=""), "unsigned"),
        ("web", _tampered(**{"class": "critical"}), "bad_signature"),
        ("web", _tampered(share_group="other"), "bad_signature"),
        ("web", _tampered(at=9e9), "bad_signature"),
        ("web", _tampered(digest=hashlib.sha256(b"mine").hexdigest()), "bad_signature"),
        ("other", dump(RECORD, KEYRING), "bad_signature"),  # a record moved to another name
        ("web", dump(RECORD, Keyring("t" * 40)), "bad_signature"),
    ],
    ids=[
        "text",
        "list",
        "null",
        "version",
        "at-string",
        "at-bool",
        "digest-int",
        "digest-short",
        "deleted-string",
        "group-list",
        "unknown-class",
        "sig-missing",
        "sig-empty",
        "class-raised",
        "group-changed",
        "at-changed",
        "digest-replaced",
        "renamed",
        "other-secret",
    ],
)
def test_records_that_cannot_be_trusted_are_refused(name: str, value: str, reason: str) -> None:
    with pytest.raises(RecordError) as err:
        load(name, value, KEYRING)
    assert err.value.reason == reason


def test_newer_wins_and_a_tie_goes_to_the_tombstone() -> None:
    later = Record("web", RECORD.digest, TenantClass.BATCH, None, RECORD.at + 1)
    assert later.newer_than(RECORD) and not RECORD.newer_than(later)
    gone = tombstone("web", RECORD.at)
    assert gone.newer_than(RECORD) and not RECORD.newer_than(gone)


def test_digests_are_keyed_and_file_sha256_keys_match_plain_ones() -> None:
    sha = hashlib.sha256(b"k" * 40).hexdigest()
    assert KEYRING.digest("k" * 40) == KEYRING.digest_of_sha256(sha) != sha
    assert Keyring("t" * 40).digest("k" * 40) != KEYRING.digest("k" * 40)
    assert KEYRING.digest("k" * 40) != KEYRING.sign(sha.encode())  # labels keep uses apart


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tenants": [{"name": "t", "api_key": "short-key"}]}, "tenants.0.api_key"),
        ({"admin": {"api_key": "k" * 31}}, "at least 32 characters"),
        ({"auth": {"mode": "open"}, "tenants": [{"name": "t", "api_key": KEY}]}, "auth.mode open"),
        ({"auth": {"mode": "open"}, "admin": {"api_key": KEY}}, "remove tenants and admin"),
        ({"index": {"backend": "redis"}, "admin": {"api_key": KEY}}, "auth.secret"),
        ({"auth": {"secret": "too-short"}}, "auth.secret"),
        ({"auth": {"mode": "closed"}}, "auth.mode"),
        (
            {"tenants": [{"name": "a", "api_key": KEY}, {"name": "b", "api_key": KEY}]},
            "'b' has the same API key as tenant 'a'",
        ),
        (
            {
                "admin": {"api_key": KEY},
                "tenants": [{"name": "a", "api_key_sha256": KEY_SHA256}],
            },
            "'a' has the same API key as the admin",
        ),
    ],
    ids=["short-tenant-key", "short-admin-key", "open-tenants", "open-admin", "redis-no-secret",
         "short-secret", "unknown-mode", "two-tenants-one-key", "tenant-with-admin-key"],
)  # fmt: skip
def test_auth_config_errors_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"pools": POOLS, **data})


def test_auth_defaults_to_keys_and_redis_takes_a_secret() -> None:
    assert parse_config({"pools": POOLS}).auth.mode == "keys"
    config = parse_config(
        {"pools": POOLS, "index": {"backend": "redis"}, "auth": {"secret": SECRET}}
    )
    assert config.auth.secret == SECRET
    open_redis = parse_config(
        {"pools": POOLS, "index": {"backend": "redis"}, "auth": {"mode": "open"}}
    )
    assert open_redis.auth.secret is None  # open mode checks no key and signs no record


def test_serve_refuses_a_short_key_at_start_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "pools: [{name: p, replicas: ['http://127.0.0.1:1']}]\n"
        "tenants: [{name: web, api_key: sekret-key}]\n"
    )
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "tenants.0.api_key" in err and "at least 32 characters" in err
    assert "sekret-key" not in err  # the key is not printed
