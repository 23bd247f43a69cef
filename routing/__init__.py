"""cachelane's routing core: prompt -> block hashes -> index lookup -> cost model -> decision.

Pure by contract: nothing in this package imports a web framework or an HTTP client
(tests/unit/test_purity.py enforces it), so every decision is a function call in a test.
"""
