"""Ranks meet before the first collective of `spmd.compile` and agree on what they compiled.

    every rank      all_gather(digest of its summary, or the error it failed with)   one small message
    any error       every rank raises: "rank 1 could not compile: ..."              (never a hang)
    digests differ  all_gather(the full summaries of the odd ranks and rank 0), then every rank raises
                    an SpmdError naming the ranks and the first difference           (never a hang)
    all equal       go on; the solver's answer is then rank 0's on every rank (`adopt_rank0`), and the
                    plans' fingerprints are compared once more after the solve

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

    def adopt_rank0(self, values):
        """Every rank takes rank 0's solution vector: HiGHS breaks ties between optimal plans by timing,
        differently in different processes (see solve_placements)."""
        box = [(len(values), values)]
        dist.broadcast_object_list(box, src=0)
        n, chosen = box[0]
        if n != len(values):  # the summaries agreed, so the programs cannot differ: a bug
            raise SpmdInternalError(f"rank {dist.get_rank()} built a placement problem with {len(values)} "
                                    f"variables, rank 0 one with {n}")
        return chosen

    def agree_on_plan(self, fingerprint: str) -> None:
        prints = self._gather(fingerprint)
        if len(set(prints)) != 1:
            raise SpmdInternalError(f"the ranks solved different plans: {prints}")
