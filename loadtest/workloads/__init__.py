"""Seeded request traces and their ideal hit rate: what the demo, benchmarks and Locust replay."""
