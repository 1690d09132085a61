"""Benchmarks of the vattn allocator: mapping bandwidth and step() latency (`make bench`)."""
