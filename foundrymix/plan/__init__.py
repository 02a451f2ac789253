"""Pure planning: the loader config, the catalog (metadata read once), the weights and exact epochs, the sample order, stages and the run plan, rendering."""
