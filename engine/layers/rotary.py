"""RoPE settings as the HF configs spell them (the cos/sin table itself is kernels.reference's)."""
from __future__ import annotations


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers 4 or 5 style configs."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return theta, scaling
