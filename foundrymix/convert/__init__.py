"""Converters: raw corpora to foundrymix MDS shards (readers -> encoders -> writer)."""
