"""Model definitions, checkpoint loading and the default model."""
