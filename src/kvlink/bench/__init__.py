"""Benchmarks that need library code: multi-process connector peers and their driver."""
