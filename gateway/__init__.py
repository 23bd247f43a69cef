"""cachelane's HTTP edge: OpenAI endpoints, streaming proxy, replica registry, metrics, CLI."""
