"""The replicas: registry, health and load scrapes, discovery, reloads, sibling workers."""
