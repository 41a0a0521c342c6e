"""Data parallelism and gradient finalisation."""
