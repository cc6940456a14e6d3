"""A pool of gloo worker processes that stays up across tests.

Starting 4 Python processes that import torch costs seconds on 2 cores, so each world size is started
once per test session (its ranks fork from a server that imported torch and spmd once: `PRELOAD`), and
every test sends its function to all ranks: `pool.run(fn, *args)` calls `fn(rank, world, *args)` on every
rank (fn must be a module-level function) and returns the per-rank results, or raises with every failing
rank's traceback. A hung collective times out and kills the pool.
"""
from __future__ import annotations

import os
import queue
import signal
import socket
import tempfile
import time
import traceback
import warnings

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RECYCLE_BYTES = 2 * 2**30


def _resident() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _unwaited() -> int:
    """How many functional collectives this process launched and has not waited for."""
    import torch._C._distributed_c10d as c10d

    return c10d._get_work_registry_size() if hasattr(c10d, "_get_work_registry_size") else 0


def _worker(rank: int, world: int, port: int, tasks, results, stacks: str, environ: dict) -> None:
    os.environ.clear()
    os.environ.update(environ)  # (the test process's now: a forked rank has the server's, from the first pool)
    os.environ["OMP_NUM_THREADS"] = "1"
    import faulthandler

    faulthandler.register(signal.SIGUSR1, file=open(stacks, "w"), all_threads=True)
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
            value = fn(rank, world, *args)
            left = _unwaited()
            if left:
                raise RuntimeError(f"{fn.__name__} returned with {left} collective(s) launched and never waited for; "
                                   "they would pair with the next test's collectives on their groups")
            results.put((rank, True, value, _resident()))
        except BaseException:  # noqa: BLE001 - report everything to the test process
            results.put((rank, False, traceback.format_exc(), _resident()))
    dist.destroy_process_group()


# What a rank imports before its first test. Started with "forkserver", every pool's ranks fork from one
# server process that imported these once: 4 ranks are up in 0.1 s, against 5-10 s for 4 spawned ones
# importing torch on 2 cores. The server runs no test and holds no thread; a rank takes the test process's
# environment when its pool starts (`_worker`), but what these modules read from it at import was read once,
# when the server started.
PRELOAD = ["torch", "torch.distributed", "spmd", "tests.support", "tests.models"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class RankDied(RuntimeError):
    """A rank's process ended while the others worked on a task (`signalled`: killed by a signal, in a pool that
    had run nothing yet)."""

    def __init__(self, message: str, signalled: bool):
        super().__init__(message)
        self.signalled = signalled


class RankPool:
    def __init__(self, world: int, timeout: float = 600.0):
        self.world, self.timeout = world, timeout
        self._start()

    def _start(self) -> None:
        ctx = _context()
        port = _free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.stacks = []
        for r in range(self.world):
            fd, path = tempfile.mkstemp(prefix=f"rank{r}-", suffix=".stacks")
            os.close(fd)  # (the rank opens it by name)
            self.stacks.append(path)
        self.procs = [ctx.Process(target=_worker, args=(r, self.world, port, self.tasks[r], self.results,
                                                        self.stacks[r], dict(os.environ)), daemon=True)
                      for r in range(self.world)]
        for p in self.procs:
            p.start()
        self.broken, self.fresh = False, True

    def run(self, fn, *args) -> list:
        try:
            return self._run(fn, args)
        except RankDied as e:
            if not e.signalled:
                raise
            # a rank of a pool that had run nothing yet was killed by a signal (once: rank 2 of 4 aborted in its
            # first gloo all_reduce, and the test it ran passes alone and in every other run): gloo's start-up,
            # not the test. Started again once, said aloud
            warnings.warn(f"a fresh pool of {self.world} ranks lost a rank ({str(e).splitlines()[0]}); started again")
            self._start()
            return self._run(fn, args)

    def _run(self, fn, args) -> list:
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, object] = {}
        errors: dict[int, str] = {}
        resident = 0
        deadline = time.monotonic() + self.timeout
        while len(out) + len(errors) < self.world:
            left = deadline - time.monotonic()
            try:
                rank, ok, value, held = self.results.get(timeout=max(0.01, min(5.0, left)))
            except queue.Empty:
                silent = sorted(set(range(self.world)) - set(out) - set(errors))
                dead = [r for r in silent if not self.procs[r].is_alive()]
                if dead:  # (no answer will come from it, and its peers wait in a collective: say so now)
                    codes = ", ".join(f"rank {r}: exit code {self.procs[r].exitcode}" for r in dead)
                    signalled = self.fresh and all((self.procs[r].exitcode or 0) < 0 for r in dead)
                    self.close(kill=True)
                    raise RankDied(f"{codes}; the other ranks were waiting\n" + "\n".join(
                        f"--- rank {r} failed ---\n{tb}" for r, tb in sorted(errors.items())), signalled)
                if left > 0:
                    continue
                where = self._where(silent)
                self.close(kill=True)
                raise TimeoutError(f"ranks {silent} did not answer in {self.timeout:.0f} s (a collective hung?)\n"
                                   f"{where}\n" + "\n".join(f"--- rank {r} failed ---\n{tb}"
                                                            for r, tb in sorted(errors.items())))
            (out if ok else errors)[rank] = value
            resident += held
        self.fresh = False
        if errors:
            self.close(kill=True)
            raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
        if resident > RECYCLE_BYTES:
            self.close()
        return [out[r] for r in range(self.world)]

    def _where(self, silent: list[int]) -> str:
        """For each rank that did not answer: its exit code if it died, else its threads' stacks."""
        for r in silent:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(2)
        lines = []
        for r in silent:
            if not self.procs[r].is_alive():
                lines.append(f"--- rank {r} died (exit code {self.procs[r].exitcode}) ---")
                continue
            with open(self.stacks[r]) as f:
                stack = f.read().strip()
            lines.append(f"--- rank {r} is alive, its threads' stacks (most recent call first) ---\n"
                         + "\n".join(stack.splitlines()[:150]))
        return "\n".join(lines)

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
        for path in self.stacks:
            if os.path.exists(path):
                os.remove(path)
