"""A pool of gloo worker processes that stays up across tests.

Spawning 4 Python processes that import torch costs seconds on 2 cores, so each world size is spawned
once per test session and every test sends its function to all ranks: `pool.run(fn, *args)` calls
`fn(rank, world, *args)` on every rank (fn must be a module-level function) and returns the per-rank
results, or raises with every failing rank's traceback. A hung collective times out and kills the pool.
"""
from __future__ import annotations

import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001 - report everything to the test process
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    def __init__(self, world: int, timeout: float = 600.0):
        self.world, self.timeout = world, timeout
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, *args) -> list:
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        try:
            for _ in range(self.world):
                rank, ok, value = self.results.get(timeout=self.timeout)
                (out if ok else errors)[rank] = value
        except queue.Empty:
            self.close(kill=True)
            raise TimeoutError(f"ranks {sorted(set(range(self.world)) - set(out) - set(errors))} did not answer "
                               f"in {self.timeout:.0f} s (a collective hung?); errors so far: {errors}")
        if errors:
            self.close(kill=True)
            raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        return [out[r] for r in range(self.world)]

    def close(self, kill: bool = False) -> None:
        if self.broken:
            return
        self.broken = True
        if not kill:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=20)
        for p in self.procs:
            if p.is_alive():
                p.kill()
