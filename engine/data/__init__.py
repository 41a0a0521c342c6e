"""Tokenizers and token sources."""
