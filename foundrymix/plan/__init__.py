"""Pure planning: the loader config, the catalog (metadata read once), exact epoch weights, the replay of streaming's sampler, stages and the run plan, rendering."""
