"""Mixing: typed loader config, manifest validation, exact plan, decoded StreamingDataset."""
