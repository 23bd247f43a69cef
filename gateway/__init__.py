"""cachelane's HTTP edge: OpenAI endpoints, streaming proxy, replica registry, metrics, CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("cachelane")  # pyproject.toml's, the one version source
except PackageNotFoundError:  # a source tree that was never pip-installed
    __version__ = "0+unknown"
