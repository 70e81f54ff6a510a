"""Metrics, benchmarks and reports (imported as `compress.eval`)."""
