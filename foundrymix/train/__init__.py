"""Training: config, model wrapper, callbacks (one table, one module each), trainer builder, report, CLI."""
