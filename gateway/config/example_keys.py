"""The example keys and secrets this repository publishes, which a gateway refuses to start with
(config `auth.allow_example_keys` excepted): anyone can read them, in deploy/ and in the image.

Values are recognised by the markers the examples carry (`change-me` in deploy/k8s's Secrets,
`not-for-production` in deploy/compose's configs), so an edited copy such as
`change-me-app-key-1111` is refused too; keys given only by their digest are recognised by the
digests deploy/examples/vllm.yaml printed (the SHA-256 of `test` and another short word)."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

EXAMPLE_MARKERS = ("change-me", "not-for-production")
EXAMPLE_DIGESTS = frozenset(
    {
        # the api_key_sha256 of the tenant and the admin that deploy/examples/vllm.yaml once
        # shipped: a deployment copied from it must not start with them
        "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
        "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752",
    }
)


def is_example(value: str | None) -> bool:
    if value is None:
        return False
    lowered = value.lower()
    return lowered in EXAMPLE_DIGESTS or any(m in lowered for m in EXAMPLE_MARKERS)


def password_of(url: str) -> str | None:
    """The password in a Redis URL, decoded; None when it has none or does not parse."""
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return None if password is None else unquote(password)
