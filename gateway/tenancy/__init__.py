"""Who a request is served as: tenants, their keys and records, the admin API, rate limits."""
