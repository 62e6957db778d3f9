"""Tensor-parallel process groups and the collectives the layers use (torch.distributed: NCCL on
CUDA, gloo on the CPU). The layers import this; the driver that starts the other ranks is
``engine.rank_executor``."""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

# NVLink multicast (NVLS) can take a host's shared GPUs out of service: keep it off in this
# process and, through the inherited environment, in every rank it spawns (set again there).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    os.environ.update(MULTICAST_OFF)


def _timeout() -> timedelta:
    # How long a collective may wait for a peer: longer than the slowest rank's weight load.
    return timedelta(seconds=float(os.environ.get("PAGESTREAM_TP_TIMEOUT_S", "600")))


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group. ``group`` is None at size 1, and also
    when a model is only being sized (built on the meta device): then nothing communicates."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1 and self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[n, d] on each rank -> [n, size * d], rank 0's columns first (every rank gets it)."""
        if self.size == 1 or self.group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


_current = TPGroup()


def current_tp() -> TPGroup:
    """The group layers built now belong to (``tensor_parallel`` sets it around model construction)."""
    return _current


@contextlib.contextmanager
def tensor_parallel(tp: TPGroup) -> Iterator[TPGroup]:
    """Build layers for ``tp``: each parallel layer keeps the group it was built under."""
    global _current
    prev, _current = _current, tp
    try:
        yield tp
    finally:
        _current = prev


def init_group(backend: str, init_method: str, rank: int, size: int, device: torch.device) -> TPGroup:
    disable_multicast()
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # create the communicator now: a broken link fails at start, not mid-step
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=_timeout(), **kwargs)
    return TPGroup(rank, size, dist.group.WORLD)




def free_port() -> int:
    """A free TCP port on this host, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
