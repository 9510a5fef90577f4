"""Benchmarks: one harness (timing, ceilings, tables, JSON) shared by every op's suite."""
