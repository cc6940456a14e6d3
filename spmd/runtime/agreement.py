"""Ranks meet before the first collective of `spmd.compile` and agree on what they compiled.

    every rank      all_gather(digest of its summary, or the error it failed with)   one small message
    any error       every rank raises: "rank 1 could not compile: ..."              (never a hang)
    digests differ  all_gather(the full summaries of the odd ranks and rank 0), then every rank raises
                    an SpmdError naming the ranks and the first difference           (never a hang)
    all equal       go on; rank 0 alone builds the placement program and solves it, and every rank
                    takes its plan (`share_plan`); the plans' fingerprints are compared once more

A rank that fails before the meeting (say, its model does not trace) still comes to it, with its error,
so that the others fail with it instead of waiting for a collective it will never join.
"""
from __future__ import annotations

import torch.distributed as dist

from spmd.compiler.agreement import differences, digest
from spmd.core.errors import SpmdError, SpmdInternalError

WHAT_TO_DO = ("What to do: build the same model with the same example inputs (shapes and dtypes), options and "
              "pins on every rank: the same script, seeds and data.")


def _shown(error: BaseException) -> str:
    """The error as the other ranks show it: its type and whole message (a refusal's list of problems and its way
    out are on the lines after the first), within 3,000 characters, the lines after the first indented."""
    text = f"{type(error).__name__}: {error}"
    text = text if len(text) <= 3000 else text[:3000] + " ..."
    return "\n    ".join(text.splitlines())


def _stopped(failed: list[tuple[int, str]]) -> SpmdError:
    """The error every rank raises when some failed: (rank, its error line) each."""
    lines = "\n".join(f"  rank {r} could not compile: {e}" for r, e in failed)
    return SpmdError(f"compile stopped on every rank because {len(failed)} rank(s) failed:\n{lines}")


class Rendezvous:
    def __init__(self):
        self.met = False  # every rank has been at the first meeting
        self.plan_pending = False  # met, and rank 0's plan not yet shared (`share_plan`)
        self.plan_agreed = False  # every rank has been at the second meeting (`agree_on_plan`)

    def _gather(self, payload) -> list:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, payload)
        return out

    def agree_on(self, summary: dict[str, list[str]]) -> None:
        """Every rank calls this with its summary (compiler/agreement.py); raises on every rank alike."""
        digests = self._gather({"digest": digest(summary)})
        first, self.met = not self.met, True
        failed = [(r, d["error"]) for r, d in enumerate(digests) if "error" in d]
        if failed:
            self.plan_agreed = True  # every rank raises here: no meeting after this one
            raise _stopped(failed)
        digests = [d["digest"] for d in digests]
        odd = sorted({r for r, d in enumerate(digests) if d != digests[0]})
        if not odd:
            self.plan_pending = self.plan_pending or first  # the first meeting: the plan comes next
            return
        self.plan_agreed = True  # likewise
        rank = dist.get_rank()
        summaries = self._gather(summary if rank in odd or rank == 0 else None)
        lines = differences(digests, {r: s for r, s in enumerate(summaries) if s is not None})
        raise SpmdError("the ranks did not compile the same thing (running on would hang or compute wrong "
                        "results):\n" + "\n".join(f"  {line}" for line in lines) + "\n" + WHAT_TO_DO)

    def fail(self, error: BaseException) -> None:
        """A rank that failed on its way to a meeting brings its error there (then re-raises it), so that
        every rank raises and none waits for it. Between the meetings the others wait for rank 0's plan:
        a failing rank 0 sends its error instead, a failing other rank takes part in that one broadcast;
        then both go to the second meeting (`agree_on_plan`) with the error."""
        if not dist.is_initialized():
            return
        message = {"error": _shown(error)}
        if not self.met:
            self._gather(message)
            self.met = True
            return
        if self.plan_pending:
            if self.plans_here():
                self._send_failure(error)
            else:
                self.plan_pending = False
                dist.broadcast_object_list([None], src=0)
        if not self.plan_agreed:
            self._gather(message)
            self.plan_agreed = True

    def plans_here(self) -> bool:
        """Whether this rank makes the plan (`share_plan`): rank 0."""
        return dist.get_rank() == 0

    def share_plan(self, make):
        """Rank 0 runs `make()` (builds the placement program and solves it) and every rank takes its
        plan; the others build nothing (their pipelines skip the strategy and cost tables) and wait.
        One plan is also the only safe answer: HiGHS breaks ties between optimal plans by timing,
        differently in different processes, and where branch and bound stops on its time limit the plan
        depends on the machine's load. Where ranks share a host's cores (gloo on CPU, a CI box, 8 GPUs'
        ranks on one node's CPUs), they no longer plan the same model 8 times at once: 8 gloo ranks on
        2 cores spent 64 s compiling a small GPT, 40 s of it in those passes.
        If rank 0 fails before it has a plan, every rank raises with its error (see `fail`)."""
        box = [None]
        if self.plans_here():
            try:
                box[0] = ("ok", make())
            except BaseException as e:
                self._send_failure(e)
                raise
        self.plan_pending = False
        dist.broadcast_object_list(box, src=0)
        kind, plan = box[0]
        if kind == "error":
            raise SpmdError(f"rank 0 could not plan: {plan}")
        return plan

    def _send_failure(self, error: BaseException) -> None:
        """Rank 0 failed while the others wait for its plan: bring them the error (one broadcast, the one
        they wait in)."""
        self.plan_pending = False
        dist.broadcast_object_list([("error", _shown(error))], src=0)

    def agree_on_plan(self, fingerprint: str) -> None:
        """The second meeting, after code generation: every rank brings its plan's fingerprint, or the
        error it failed with since the first meeting (`fail`); raises on every rank alike."""
        prints = self._gather(fingerprint)
        self.plan_agreed = True
        failed = [(r, p["error"]) for r, p in enumerate(prints) if isinstance(p, dict)]
        if failed:
            raise _stopped(failed)
        if len(set(prints)) != 1:
            raise SpmdInternalError(f"the ranks solved different plans: {prints}")
