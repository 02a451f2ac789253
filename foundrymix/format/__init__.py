"""The on-disk contract both sides import: the row schema and manifest, shard files and hashes, the lean MDS writer."""
