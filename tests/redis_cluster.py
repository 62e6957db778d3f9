"""A real 3-master Redis Cluster on free loopback ports, from ``redis-server`` and ``redis-cli --cluster create``.

The e2e tests run against it through the ``redis_url`` fixture (``conftest.py``): a test marked
``also_on_cluster`` runs once on the single node and once here. RQ does not run on a cluster, so
a plain single-node ``redis-server`` rides beside it for the bulk queue (``PAGESTREAM_RQ_REDIS_URL``).
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import redis
from redis.cluster import RedisCluster

from tests.private_redis import free_port


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too; Redis refuses ports above 55535."""
    import random
    import socket

    for _ in range(1000):
        port = random.randint(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterProcs:
    def __init__(self, num_masters: int = 3) -> None:
        if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
            raise RuntimeError("redis-server and redis-cli must be on PATH for the cluster tests")
        self.dir = tempfile.mkdtemp(prefix="pagestream-cluster-")
        self.ports = [free_cluster_port() for _ in range(num_masters)]
        self.procs: list[subprocess.Popen] = []
        try:
            for port in self.ports:
                self.procs.append(self._server(port, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                                               "--cluster-node-timeout", "5000"))
            for port in self.ports:
                self._wait_ping(port)
            subprocess.run(["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=60)
            self._wait_ok()
            self.rq_port = free_port()
            self.procs.append(self._server(self.rq_port))
            self._wait_ping(self.rq_port)
        except BaseException:
            self.stop()
            raise
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"
        self.rq_url = f"redis://127.0.0.1:{self.rq_port}/0"

    def _server(self, port: int, *args: str) -> subprocess.Popen:
        return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", self.dir,
                                 "--save", "", "--appendonly", "no", *args],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def _wait_ping(port: int, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if redis.Redis(port=port, socket_connect_timeout=0.5).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not start")

    def _wait_ok(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            states = [redis.Redis(port=p).cluster("info").get("cluster_state") for p in self.ports]
            if all(s == "ok" for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"cluster on {self.ports} not ok after {timeout}s")

    def client(self, **kwargs) -> RedisCluster:
        return RedisCluster(host="127.0.0.1", port=self.ports[0], **kwargs)

    def flush(self) -> None:
        """FLUSHALL on every master and on the RQ node (the per-test clean slate of ``redis_url``)."""
        for p in [*self.ports, self.rq_port]:
            redis.Redis(port=p).flushall()

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
