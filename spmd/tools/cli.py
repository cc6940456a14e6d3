"""`spmd` on the command line (also `python -m spmd`): plan without processes, explain, diff.

    spmd plan path/to/model.py:build --mesh dp=2,tp=4 [--device h100] [--link dp=infiniband,tp=nvlink]
              [--training] [--memory-budget-gib 40] [--svg out.svg] [--html out.html] [--json plan.json]
              [--explain]
    spmd explain plan.json
    spmd diff a.json b.json           (exit status 1 when the plans differ, like diff)
    spmd calibrate ...                (spmd.tools.calibrate: measure link and device profiles)

The build function contract: `build()` takes no arguments and returns `(model, example_inputs)` or
`(model, example_inputs, loss_fn)`; `example_inputs` is a tuple of full-size tensors (or one tensor), or a
dict of them for a model that takes keyword inputs (a transformers model: `dict(input_ids=..., labels=...)`).
With a `loss_fn` the plan is for training (`loss_fn(model(*inputs), *targets)`, targets the trailing
inputs); `--training` without one plans the joint forward+backward graph of the bare model.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import sys
import threading
import time
import traceback
from pathlib import Path

from spmd.api import plan as plan_model
from spmd.core.errors import SpmdError
from spmd.core.mesh import MeshSpec, parse_mesh
from spmd.core.profiles import device_profile_for, link_profile_for
from spmd.report.diff import diff_plans
from spmd.report.render import check_format
from spmd.report.result import load_plan
from spmd.tools import calibrate


def _links(text: str | None, names: tuple[str, ...]):
    """"nvlink" for every axis, or "dp=infiniband,tp=nvlink"; None: MeshSpec's defaults."""
    if not text:
        return ()
    if "=" not in text:
        return tuple(link_profile_for(text) for _ in names)
    given = dict(p.split("=", 1) for p in text.split(","))
    unknown = set(given) - set(names)
    if unknown or set(given) != set(names):
        raise SpmdError(f"--link {text!r}: give one link per mesh axis {list(names)} (or one name for all)")
    return tuple(link_profile_for(given[n]) for n in names)


def load_build(target: str):
    """"path/to/file.py:build" (or "package.module:build") -> the build function."""
    where, colon, fn = target.rpartition(":")
    if not colon or not where or not fn:
        raise SpmdError(f"{target!r}: expected path/to/model.py:build_fn")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.exists():
            raise SpmdError(f"{where}: no such file")
        sys.path.insert(0, str(path.parent))  # so the model file can import its neighbours
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        _users(lambda: spec.loader.exec_module(module), f"{where}, run as a module")
    else:
        module = _users(lambda: importlib.import_module(where), f"import {where}")
    build = getattr(module, fn, None)
    if not callable(build):
        raise SpmdError(f"{target}: {where} has no function {fn!r}")
    try:
        inspect.signature(build).bind()
    except TypeError:
        raise SpmdError(f"{target}: {fn}{inspect.signature(build)} needs arguments; the build function takes none "
                        "and returns (model, example_inputs) or (model, example_inputs, loss_fn). What to do: give "
                        "its parameters defaults, or wrap it: `def build(): return my_build(...)`.") from None
    except ValueError:
        pass  # (no signature to read: a builtin; calling it says what is wrong)
    return build


def _users(run, what: str):
    """`run()`, the user's code: what it raises is said with its type and traceback (a probe's build function that
    raised ValueError was printed as "spmd plan: boom", taken for spmd's own argument error)."""
    try:
        return run()
    except SpmdError:
        raise
    except Exception as e:
        raise SpmdError(f"{what} raised {type(e).__name__}: {e}\n\n" + "".join(
            traceback.format_exception(type(e), e, e.__traceback__.tb_next))) from e


class Progress:
    """A stderr line for work that takes more than a second (rewritten in place on a terminal)."""

    def __init__(self, what: str, stream=None, after: float = 1.0):
        self.what, self.stream, self.after = what, stream or sys.stderr, after
        self._stop = threading.Event()
        self._shown = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        if self._stop.wait(self.after):
            return
        tty = self.stream.isatty()
        while True:
            self._shown = True
            line = f"{self.what} ... {time.perf_counter() - t0:.0f} s"
            self.stream.write(("\r" + line) if tty else line + "\n")
            self.stream.flush()
            if not tty or self._stop.wait(0.5):
                return

    def __enter__(self):
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        if self._shown:
            end = "\n" if self.stream.isatty() else ""
            self.stream.write(f"{end}{self.what}: done in {time.perf_counter() - self.t0:.1f} s\n")
            self.stream.flush()


def _cmd_plan(args) -> int:
    import torch

    try:
        shape, names = parse_mesh(args.mesh)
    except ValueError as e:
        raise SpmdError(f"--mesh: {e}") from None
    mesh = MeshSpec(shape, names, _links(args.link, names), device_profile_for(args.device))
    build = load_build(args.target)
    built = _users(build, f"{args.target}()")
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise SpmdError(f"{args.target} returned {type(built).__name__}; expected (model, example_inputs) or "
                        "(model, example_inputs, loss_fn)")
    model, inputs = built[0], built[1]
    loss_fn = built[2] if len(built) == 3 else None
    if not isinstance(model, torch.nn.Module):
        raise SpmdError(f"{args.target} returned a {type(model).__name__} as the model; expected an nn.Module. What to "
                        "do: return the module (wrap a function in an nn.Module whose forward calls it).")
    if args.json and Path(args.json).is_dir():  # (before planning: it was found after, with a raw error)
        raise SpmdError(f"--json {args.json} is a folder; expected a file to write the plan to.")
    for flag, out in (("--svg", args.svg), ("--html", args.html)):  # (before planning: a probe found a .jpg
        if out:                                                        # refused after the plan and its --json)
            try:
                check_format(out)
            except ValueError as e:
                raise SpmdError(f"{flag} {out}: {str(e).removeprefix('visualize: ')}.") from None
    if args.memory_budget_gib is not None and args.memory_budget_gib <= 0:
        raise SpmdError(f"--memory-budget-gib {args.memory_budget_gib}: expected a positive number of GiB per rank.")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    # (a dict: keyword inputs, as a transformers model takes them; `tuple(dict)` gave its keys, found by a probe)
    kwargs, inputs = (dict(inputs), ()) if isinstance(inputs, dict) else (None, tuple(inputs))
    budget = args.memory_budget_gib * 2**30 if args.memory_budget_gib else None
    with Progress(f"planning {type(model).__name__} on mesh {mesh}"):
        plan = plan_model(model, mesh, inputs, example_kwargs=kwargs, loss_fn=loss_fn,
                          training=True if args.training or loss_fn is not None else None, memory_budget=budget)
    print(plan.explain() if args.explain else plan)
    if args.json:
        plan.save(args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    for out in (args.svg, args.html):
        if out:
            written = plan.visualize(out, title=type(model).__name__)
            print(f"wrote {written}", file=sys.stderr)
    return 0


def _cmd_explain(args) -> int:
    print(load_plan(args.plan).explain(), end="")
    return 0


def _cmd_diff(args) -> int:
    d = diff_plans(load_plan(args.a), load_plan(args.b))
    print(d)
    return 1 if d else 0


def _calibrate(argv: list[str]) -> int:
    return int(calibrate.main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spmd", description="Plan, explain and compare SPMD partitionings.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a model on a mesh, without processes",
                       description="Plan a model without launching processes. TARGET is path/to/model.py:build; "
                                   "build() returns (model, example_inputs) or (model, example_inputs, loss_fn).")
    p.add_argument("target", help="path/to/model.py:build_fn")
    p.add_argument("--mesh", required=True, help="axis=size pairs, outer axis first: dp=2,tp=4")
    p.add_argument("--device", default="h100", help="device profile: h100, h200, a100, cpu (default h100)")
    p.add_argument("--link", help="link profile for every axis (nvlink, infiniband, gloo) or per axis: "
                                  "dp=infiniband,tp=nvlink (default: inner axis nvlink, outer infiniband)")
    p.add_argument("--training", action="store_true", help="plan the joint forward+backward graph")
    p.add_argument("--memory-budget-gib", type=float, help="bytes per rank the plan must fit in, in GiB")
    p.add_argument("--svg", help="draw the sharded graph (.svg, .png, .dot)")
    p.add_argument("--html", help="a self-contained page: the picture and the plan explained")
    p.add_argument("--json", help="save the plan (spmd explain / spmd diff read it)")
    p.add_argument("--explain", action="store_true", help="print the full explanation, not the short plan")
    p.set_defaults(run=_cmd_plan)

    e = sub.add_parser("explain", help="explain a saved plan")
    e.add_argument("plan", help="plan.json")
    e.set_defaults(run=_cmd_explain)

    d = sub.add_parser("diff", help="compare two saved plans (exit 1 if they differ)")
    d.add_argument("a")
    d.add_argument("b")
    d.set_defaults(run=_cmd_diff)

    c = sub.add_parser("calibrate", help="measure link and device profiles (spmd.tools.calibrate)",
                       add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER, help="arguments for spmd.tools.calibrate")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:  # everything after it is calibrate's own (argparse would eat --help)
        return _calibrate(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (SpmdError, ValueError, FileNotFoundError) as e:
        print(f"spmd {args.command}: {e}", file=sys.stderr)
        return 2
