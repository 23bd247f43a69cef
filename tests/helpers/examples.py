"""The environment the example configs in deploy/examples/ read: the keys
deploy/examples/sim-tenants.yaml takes from ${VOICE_KEY}, ${WEB_KEY} and ${ADMIN_KEY}."""

EXAMPLE_ENV = {name: f"{name.lower()}-{'0' * 40}" for name in ("VOICE_KEY", "WEB_KEY", "ADMIN_KEY")}
