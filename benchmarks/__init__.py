"""Benchmarks: scripts that print ratios against the peers (not tests)."""
