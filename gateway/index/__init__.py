"""Index backends that do IO: Redis and Redis Cluster (redis_backend.py), and the wrapper that
keeps a local MemoryIndex in step and routes on it while Redis is away (resilient.py).

The `Index` protocol and the memory index live in the pure core (routing/index.py); a backend
here implements that protocol, passes the contract suite (tests/contract/test_index_contract.py)
and is chosen in gateway/state.py's build_index. docs/extending.md walks through adding one.
"""
