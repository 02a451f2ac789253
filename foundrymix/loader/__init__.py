"""Runtime: the loader built from the run plan, the dataset, the node-local cache, collate, and the one adapter over streaming's private runtime internals."""
