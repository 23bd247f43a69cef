"""Locust scenarios: `cachelane locust ...` (installed) or `locust -f loadtest/locust/locustfile.py
...` (a checkout); see locustfile.py."""
