"""Ranks meet before the first collective of `spmd.compile` and agree on what they compiled.

    every rank      all_gather(digest of its summary, or the error it failed with)   one small message
    any error       every rank raises: "rank 1 could not compile: ..."              (never a hang)
    digests differ  all_gather(the full summaries of the odd ranks and rank 0), then every rank raises
                    an SpmdError naming the ranks and the first difference           (never a hang)
    all equal       go on; rank 0 alone runs the solver and every rank takes its answer
                    (`solve_on_rank0`), and the plans' fingerprints are compared once more after it

A rank that fails before the meeting (say, its model does not trace) still comes to it, with its error,
so that the others fail with it instead of waiting for a collective it will never join.
"""
from __future__ import annotations

import torch.distributed as dist

from spmd.compiler.agreement import differences, digest
from spmd.core.errors import SpmdError, SpmdInternalError

WHAT_TO_DO = ("What to do: build the same model with the same example inputs (shapes and dtypes), options and "
              "pins on every rank: the same script, seeds and data.")


class Rendezvous:
    def __init__(self):
        self.met = False  # every rank has been at the first meeting

    def _gather(self, payload) -> list:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, payload)
        return out

    def agree_on(self, summary: dict[str, list[str]]) -> None:
        """Every rank calls this with its summary (compiler/agreement.py); raises on every rank alike."""
        digests = self._gather({"digest": digest(summary)})
        self.met = True
        failed = [(r, d["error"]) for r, d in enumerate(digests) if "error" in d]
        if failed:
            lines = "\n".join(f"  rank {r} could not compile: {e}" for r, e in failed)
            raise SpmdError(f"compile stopped on every rank because {len(failed)} rank(s) failed:\n{lines}")
        digests = [d["digest"] for d in digests]
        odd = sorted({r for r, d in enumerate(digests) if d != digests[0]})
        if not odd:
            return
        rank = dist.get_rank()
        summaries = self._gather(summary if rank in odd or rank == 0 else None)
        lines = differences(digests, {r: s for r, s in enumerate(summaries) if s is not None})
        raise SpmdError("the ranks did not compile the same thing (running on would hang or compute wrong "
                        "results):\n" + "\n".join(f"  {line}" for line in lines) + "\n" + WHAT_TO_DO)

    def fail(self, error: BaseException) -> None:
        """A rank that failed before the meeting brings its error there (then re-raises it)."""
        if not self.met and dist.is_initialized():
            self._gather({"error": f"{type(error).__name__}: {error}".splitlines()[0][:500]})
            self.met = True

    def solve_on_rank0(self, solve, n_columns: int):
        """Rank 0 runs `solve()` (the placement program's solver) and every rank takes its result: the
        other ranks wait instead of solving the same program again. One answer is also the only safe
        one: HiGHS breaks ties between optimal plans by timing, differently in different processes,
        and where branch and bound stops on its time limit the plan depends on the machine's load.
        Solving once also keeps the ranks off each other's cores where they share a host (a CI box,
        gloo on CPU): four ranks solving at once on two cores took the dual simplex past its switch to
        interior point. `n_columns`: this rank's program size, checked against rank 0's."""
        box = [None]
        if dist.get_rank() == 0:
            try:
                box[0] = ("ok", solve())
            except BaseException as e:  # the other ranks wait in the broadcast: bring them the error
                dist.broadcast_object_list([("error", f"{type(e).__name__}: {e}")], src=0)
                raise
        dist.broadcast_object_list(box, src=0)
        kind, result = box[0]
        if kind == "error":
            raise SpmdError(f"rank 0 could not solve the placement program: {result}")
        if len(result.values) != n_columns:  # the summaries agreed, so the programs cannot differ: a bug
            raise SpmdInternalError(f"rank {dist.get_rank()} built a placement problem with {n_columns} "
                                    f"variables, rank 0 one with {len(result.values)}")
        return result

    def agree_on_plan(self, fingerprint: str) -> None:
        prints = self._gather(fingerprint)
        if len(set(prints)) != 1:
            raise SpmdInternalError(f"the ranks solved different plans: {prints}")
