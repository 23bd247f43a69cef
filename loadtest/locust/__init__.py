"""Locust scenarios: `locust -f loadtest/locust/locustfile.py ...` (see locustfile.py)."""
