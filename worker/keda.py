"""KEDA ``ScaledObject``s that scale one model's workers on the Redis Streams lag of its lanes.

A worker started with ``--served-model-name M`` reads M's lanes (``keys.jobs_stream(lane, M)``, one
stream per lane on a single node, ``keys.lane_stream_shards`` on a cluster) in the consumer group
``keys.DEFAULT_GROUP``: exactly what KEDA's ``redis-streams`` scaler reads. Per stream two triggers:
``lagCount`` (entries not yet delivered to the group: work waiting; it activates from zero) and
``pendingEntriesCount`` (delivered, not acknowledged: work in flight, which keeps its workers while
they finish it). The stream names and group come from ``producer/protocol`` here, not a copy, so a
rename there reaches the manifests (``tests/test_deploy.py``).

    python -m pagestream.worker.keda --model llama-8b --deployment pagestream-worker-llama-8b \\
        --redis-address redis:6379 > scaledobject.yaml
"""
from __future__ import annotations

from typing import Any, Optional

import typer

from pagestream.producer.protocol import keys


def triggers(model: str, *, redis_addresses: list[str], num_shards: int = 1, lag_per_worker: int = 64,
             pending_per_worker: int = 256, activation_lag: int = 0, database_index: int = 0,
             cluster: bool = False, auth_ref: str | None = None) -> list[dict[str, Any]]:
    """The ``spec.triggers`` of ``model``'s ScaledObject: lag and pending of every stream of its lanes."""
    out: list[dict[str, Any]] = []
    conn: dict[str, str] = {"addresses": ",".join(redis_addresses)} if cluster else {"address": redis_addresses[0]}
    if not cluster and database_index:
        conn["databaseIndex"] = str(database_index)
    for lane in keys.LANES:
        for shard, stream in enumerate(keys.lane_stream_shards(lane, model, num_shards)):
            base = {"stream": stream, "consumerGroup": keys.DEFAULT_GROUP, **conn}
            where = lane if num_shards == 1 else f"{lane}-s{shard}"
            for kind, metadata in (("lag", {"lagCount": str(lag_per_worker), "activationLagCount": str(activation_lag)}),
                                   ("pending", {"pendingEntriesCount": str(pending_per_worker)})):
                trig: dict[str, Any] = {"type": "redis-cluster-streams" if cluster else "redis-streams",
                                        "name": f"{where}-{kind}", "metadata": {**base, **metadata}}
                if auth_ref:
                    trig["authenticationRef"] = {"name": auth_ref}
                out.append(trig)
    return out


def scaled_object(model: str, *, deployment: str, redis_addresses: list[str], namespace: str | None = None,
                  min_replicas: int = 0, max_replicas: int = 8, cooldown_s: int = 300, polling_s: int = 15,
                  **trigger_options: Any) -> dict[str, Any]:
    """A ``keda.sh/v1alpha1`` ScaledObject scaling Deployment ``deployment`` (the workers of ``model``);
    ``min_replicas=0`` scales to zero when the model's lanes are empty and nothing is in flight."""
    metadata: dict[str, Any] = {"name": deployment, "labels": {"app.kubernetes.io/name": "pagestream",
                                                               "app.kubernetes.io/component": "worker",
                                                               "pagestream.io/model": _label(model)}}
    if namespace:
        metadata["namespace"] = namespace
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment},
            "minReplicaCount": min_replicas,
            "maxReplicaCount": max_replicas,
            "pollingInterval": polling_s,
            "cooldownPeriod": cooldown_s,
            "triggers": triggers(model, redis_addresses=redis_addresses, **trigger_options),
        },
    }


def _label(model: str) -> str:
    """A model name as a label value (63 characters of [A-Za-z0-9-_.], alphanumeric at both ends)."""
    import re

    return re.sub(r"[^A-Za-z0-9._-]", "-", model)[:63].strip("-_.") or "model"


def main(
    model: str = typer.Option(..., "--model", help="the served-model name its workers announce"),
    deployment: str = typer.Option(..., "--deployment", help="the worker Deployment to scale"),
    redis_address: str = typer.Option("redis:6379", "--redis-address", help="host:port; on a cluster, comma-separated nodes"),
    cluster: bool = typer.Option(False, "--cluster", help="Redis Cluster (redis-cluster-streams triggers)"),
    num_shards: int = typer.Option(1, "--lane-shards", help="streams per lane (PAGESTREAM_LANE_SHARDS on a cluster)"),
    namespace: Optional[str] = typer.Option(None, "--namespace"),
    min_replicas: int = typer.Option(0, "--min-replicas", help="0: scale to zero when idle"),
    max_replicas: int = typer.Option(8, "--max-replicas"),
    lag_per_worker: int = typer.Option(64, "--lag-per-worker", help="undelivered entries one more worker is added for"),
    pending_per_worker: int = typer.Option(256, "--pending-per-worker", help="in-flight entries one worker holds (its max_num_seqs)"),
    auth_ref: Optional[str] = typer.Option(None, "--auth-ref", help="a TriggerAuthentication with the Redis password"),
) -> None:
    """Print the ScaledObject for one model's workers as YAML."""
    import yaml

    doc = scaled_object(model, deployment=deployment, redis_addresses=redis_address.split(","), namespace=namespace,
                        min_replicas=min_replicas, max_replicas=max_replicas, num_shards=num_shards, cluster=cluster,
                        lag_per_worker=lag_per_worker, pending_per_worker=pending_per_worker, auth_ref=auth_ref)
    typer.echo(yaml.safe_dump(doc, sort_keys=False), nl=False)


if __name__ == "__main__":
    typer.run(main)
