"""Training: Composer model wrapper, callbacks, trainer builder."""
