"""The benchmarks (one module each, `python -m loadtest.bench.<name>`) and their harness: process
launch, the peer routers, open-loop replay, reports."""
