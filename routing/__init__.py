"""cachelane's routing core: prompt -> block hashes -> index lookup -> cost model -> decision.

Pure by contract: nothing in this package does IO or imports a web framework, an HTTP client, a
Redis or ZMQ client, a wire or template library, asyncio or a metrics client
(tests/unit/test_purity.py enforces it), so every decision is a function call in a test. The
adapters live in gateway/: index backends in gateway/index/, engine integrations in
gateway/engines/. Routing policies are one module each in routing/policies/.
"""
