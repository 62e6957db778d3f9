"""``/v1/completions``."""
