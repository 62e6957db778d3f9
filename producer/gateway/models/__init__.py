"""``/v1/models`` and the directory of served models every other family checks against."""
