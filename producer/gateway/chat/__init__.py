"""``/v1/chat/completions``."""
