"""`cachelane keygen NAME`: a fresh API key and the config entry that names it by its digest, so
the key itself never sits in a config file. With `--admin`, the `admin:` entry instead."""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from typing import Any

from gateway.tenancy.keys import sha256_hex
from gateway.tenancy.tenants import name_problem
from routing.types import TenantClass

KEY_BYTES = 32  # 256 bits in 64 hex characters, as `openssl rand -hex 32` makes


def add_parser(sub: Any) -> None:
    """Register `keygen` on the CLI's subcommands."""
    p = sub.add_parser(
        "keygen",
        help="make an API key and the config entry (tenants: or admin:) that names its digest",
        description=__doc__,
    )
    p.add_argument("name", nargs="?", help="the tenant's name (not with --admin)")
    p.add_argument(
        "--class",
        dest="tenant_class",
        choices=[c.value for c in TenantClass],
        default=TenantClass.STANDARD.value,
        help="the tenant's class (default: standard)",
    )
    p.add_argument("--share-group", help="tenants of one group share cached prefixes")
    p.add_argument("--admin", action="store_true", help="a key for the admin API instead")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.admin == bool(args.name):
        print("cachelane keygen: give a tenant NAME, or --admin", file=sys.stderr)
        return 2
    if args.name and (problem := name_problem(args.name)) is not None:
        print(f"cachelane keygen: tenant name {args.name!a} {problem}", file=sys.stderr)
        return 2
    key = secrets.token_hex(KEY_BYTES)
    digest = sha256_hex(key)
    if args.admin:
        entry = f'admin: {{api_key_sha256: "{digest}"}}'
        who = "the admin key"
    else:
        fields = [f"name: {json.dumps(args.name)}", f"class: {args.tenant_class}"]
        if args.share_group:
            fields.append(f"share_group: {json.dumps(args.share_group)}")
        entry = "tenants:\n  - {" + ", ".join([*fields, f'api_key_sha256: "{digest}"']) + "}"
        who = f"the key of tenant {args.name!a}"
    print(f"# {who}; the config keeps only its SHA-256, so keep the key itself now:")
    print(key)
    print("# the config entry:")
    print(entry)
    return 0
