"""torch.distributed helpers for data-parallel collection: who am I, my share, wait for all.

Usage (`torchrun --nproc-per-node 2 -m tensorbend collect ...` sets the environment):
    ctx = DistContext.from_env()          # rank 0 of 1 without torchrun
    lo, hi = ctx.share(len(prompts))      # this rank's contiguous block of prompts
    ...work...
    ctx.barrier()                         # everyone's shards are on disk
    ctx.close()

The process group is torch.distributed's own (gloo on CPU, NCCL when the device is CUDA),
initialised from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); nothing
here moves tensors between ranks: each rank writes its own files on a shared filesystem and
rank 0 indexes them once all are done. Shares are contiguous blocks in input order, so rank
r's rows come before rank r+1's and the merged trace loads in the single-process order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from tensorbend.errors import TensorbendError


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    initialised: bool = False

    @classmethod
    def from_env(cls, backend: str | None = None, timeout_s: float = 1800) -> DistContext:
        """Join torchrun's group when WORLD_SIZE > 1 (gloo unless `backend`); else a single rank."""
        world = cls.world_size_from_env()
        if world <= 1:
            return cls()
        rank = int(os.environ.get("RANK", "-1"))
        if not 0 <= rank < world or "MASTER_ADDR" not in os.environ:
            raise TensorbendError(
                f"distributed run: expected torchrun's RANK in [0, {world}) and MASTER_ADDR, "
                f"found RANK={os.environ.get('RANK')!r}; launch with `torchrun --nproc-per-node "
                f"N -m tensorbend ...`"
            )
        if not dist.is_initialized():
            dist.init_process_group(
                backend or "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
            )
        return cls(rank, world, True)

    @staticmethod
    def world_size_from_env() -> int:
        """Processes torchrun started (1 without torchrun); reads the environment only."""
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, n: int) -> tuple[int, int]:
        """[lo, hi): this rank's contiguous block of n items (sizes differ by at most one)."""
        base, extra = divmod(n, self.world_size)
        lo = self.rank * base + min(self.rank, extra)
        return lo, lo + base + (1 if self.rank < extra else 0)

    def barrier(self) -> None:
        if self.initialised:
            dist.barrier()

    def close(self) -> None:
        if self.initialised and dist.is_initialized():
            dist.destroy_process_group()
        self.initialised = False
