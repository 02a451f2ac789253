"""Runtime: the run's DataLoader built from the plan, its row store, the node-local cache, collate."""
