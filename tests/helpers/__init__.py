"""Helpers only the tests use: real servers on loopback, free ports, throwaway Redis servers."""
