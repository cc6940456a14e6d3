"""The command line in this process (`cli.main`, what the `spmd` script and `python -m spmd` call): plan,
explain, diff, calibrate forwarded, and the messages for what cannot be done. The script itself, run as
users run it, is in tests/e2e/test_cli.py."""
import importlib.metadata
import io

import pytest

from spmd.tools import cli

BUILD = '''
import torch
import torch.nn.functional as F
from tests.models import MLP


def build():
    torch.manual_seed(0)
    return MLP(16, 64), (torch.randn(8, 16),)


def build_training():
    torch.manual_seed(0)
    return MLP(16, 64), (torch.randn(8, 16), torch.randn(8, 16)), lambda y, t: F.mse_loss(y, t)


NOT_A_FUNCTION = 3
'''


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plan files: forward on (dp=2, tp=2) with its picture source, and training on (dp=2)."""
    d = tmp_path_factory.mktemp("cli")
    (d / "model.py").write_text(BUILD)
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        assert cli.main(["plan", f"{d / 'model.py'}:build", "--mesh", "dp=2,tp=2", "--link", "gloo", "--device",
                         "cpu", "--json", str(d / "fwd.json"), "--svg", str(d / "fwd.dot")]) == 0
        assert cli.main(["plan", f"{d / 'model.py'}:build_training", "--mesh", "dp=2", "--json",
                         str(d / "train.json"), "--explain"]) == 0
    return d, out.getvalue()


def test_plan_prints_the_plan_and_writes_files(plans):
    d, out = plans
    assert "Plan on mesh (dp=2, tp=2)" in out
    assert (d / "fwd.json").exists() and (d / "fwd.dot").read_text().startswith("digraph spmd")
    assert "gradients" in out and "(backward)" in out  # --explain on the training plan: the full table


def test_explain_and_diff_saved_plans(plans, capsys):
    d, _ = plans
    assert cli.main(["explain", str(d / "fwd.json")]) == 0
    out = capsys.readouterr().out
    assert "Modules (layout per mesh axis):" in out and "Collectives per call:" in out
    assert cli.main(["diff", str(d / "fwd.json"), str(d / "fwd.json")]) == 0
    assert "plans are the same" in capsys.readouterr().out
    assert cli.main(["diff", str(d / "fwd.json"), str(d / "train.json")]) == 1  # like diff(1): they differ
    out = capsys.readouterr().out
    assert "mesh: (dp=2, tp=2) -> (dp=2)" in out and "only in b" in out and "estimated time:" in out


def test_user_errors_say_what_to_do(tmp_path, capsys):
    assert cli.main(["plan", "x.py:build", "--mesh", "dp:2"]) == 2
    assert "expected axis=size pairs like dp=2,tp=4" in capsys.readouterr().err
    assert cli.main(["plan", str(tmp_path / "missing.py") + ":build", "--mesh", "dp=2"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["explain", str(tmp_path / "none.json")]) == 2
    assert "none.json" in capsys.readouterr().err
    (tmp_path / "model.py").write_text(BUILD)
    assert cli.main(["plan", f"{tmp_path / 'model.py'}:build_missing", "--mesh", "dp=2"]) == 2
    assert "has no function 'build_missing'" in capsys.readouterr().err
    assert cli.main(["plan", f"{tmp_path / 'model.py'}:NOT_A_FUNCTION", "--mesh", "dp=2"]) == 2
    assert "has no function 'NOT_A_FUNCTION'" in capsys.readouterr().err
    # found by a probe: a build function with parameters raised a bare TypeError; a size-0 axis got the
    # syntax message
    (tmp_path / "needs.py").write_text("def build(width):\n    raise AssertionError('not called')\n")
    assert cli.main(["plan", f"{tmp_path / 'needs.py'}:build", "--mesh", "dp=2"]) == 2
    assert "build(width) needs arguments; the build function takes none" in capsys.readouterr().err
    assert cli.main(["plan", f"{tmp_path / 'model.py'}:build", "--mesh", "dp=0"]) == 2
    assert "axis 'dp' has size 0; each axis needs at least one device" in capsys.readouterr().err
    # (found by a probe: a build that raised ValueError printed as "spmd plan: boom", like an argument of spmd's)
    (tmp_path / "raises.py").write_text("def build():\n    raise ValueError('boom in the build')\n")
    assert cli.main(["plan", f"{tmp_path / 'raises.py'}:build", "--mesh", "dp=2"]) == 2
    err = capsys.readouterr().err
    assert "raises.py:build() raised ValueError: boom in the build" in err and "Traceback" in err \
        and "raises.py\", line 2, in build" in err


def test_bad_plan_files_build_results_and_calibrate_arguments_say_what_to_do(tmp_path, capsys):
    """Found by a probe: raw AttributeError, KeyError and IsADirectoryError tracebacks from `spmd explain` and
    `spmd plan --json`; a build returning a function; calibrate arguments that wrote a profile of 1e15 B/s."""
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "cut.json").write_text('{"schema": "spmd-plan", "version": 1}')
    for bad, words in ((tmp_path / "list.json", "a JSON list, not an object"),
                       (tmp_path / "cut.json", "not a complete plan file (KeyError"), (tmp_path, "is a folder")):
        assert cli.main(["explain", str(bad)]) == 2
        err = capsys.readouterr().err
        assert words in err and "What to do" in err, err
    (tmp_path / "model.py").write_text(BUILD + "\ndef build_fn():\n    return (lambda x: x), (torch.randn(2, 2),)\n")
    assert cli.main(["plan", f"{tmp_path / 'model.py'}:build_fn", "--mesh", "dp=2"]) == 2
    assert "returned a function as the model; expected an nn.Module" in capsys.readouterr().err
    assert cli.main(["plan", f"{tmp_path / 'model.py'}:build", "--mesh", "dp=2", "--json", str(tmp_path)]) == 2
    assert "is a folder; expected a file" in capsys.readouterr().err
    assert cli.main(["plan", f"{tmp_path / 'model.py'}:build", "--mesh", "dp=2", "--memory-budget-gib", "-1"]) == 2
    assert "expected a positive number of GiB" in capsys.readouterr().err
    # (a probe: a picture format refused only after planning, printing and writing --json)
    out = tmp_path / "plan.json"
    assert cli.main(["plan", f"{tmp_path / 'model.py'}:build", "--mesh", "dp=2", "--svg", "x.jpg",
                     "--json", str(out)]) == 2
    err = capsys.readouterr()
    assert "--svg x.jpg: unknown format '.jpg'; use .svg, .png" in err.err and not err.out and not out.exists()
    for argv, words in ((["--mesh", "tp=0"], "axis 'tp' has size 0"), (["--mesh", "tp=3", "--nproc", "2"], "needs 3"),
                        (["--min-bytes", "100", "--max-bytes", "10"], "expected 1 <= min <= max"),
                        (["--num-sizes", "0"], "at least 2 sizes")):
        with pytest.raises(SystemExit):
            cli.main(["calibrate", *argv])
        assert words in capsys.readouterr().err


def test_calibrate_is_forwarded(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.calibrate, "main", lambda argv: calls.append(argv) or 0)
    assert cli.main(["calibrate", "--help", "--reps", "3"]) == 0
    assert calls == [["--help", "--reps", "3"]]  # everything after `calibrate` is calibrate's own


def test_progress_line_for_slow_work():
    stream = io.StringIO()
    with cli.Progress("planning GPT", stream, after=0.0):
        pass
    assert "planning GPT" in stream.getvalue() and "done in" in stream.getvalue()
    quiet = io.StringIO()
    with cli.Progress("planning GPT", quiet, after=5.0):
        pass
    assert quiet.getvalue() == ""


def test_the_spmd_script_runs_cli_main():
    (script,) = [ep for ep in importlib.metadata.entry_points(group="console_scripts") if ep.name == "spmd"]
    assert script.load() is cli.main


HF_BUILD = '''
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    ids = torch.randint(0, 128, (2, 8))
    return LlamaForCausalLM(cfg), dict(input_ids=ids, labels=ids)
'''


def test_a_build_returning_keyword_inputs_plans(tmp_path, capsys):
    """Found by a probe: a build returning a transformers model with a dict of keyword inputs was refused with
    advice to pass example_kwargs, which no command line can (the dict was taken as a tuple of its keys)."""
    (tmp_path / "hf.py").write_text(HF_BUILD)
    assert cli.main(["plan", f"{tmp_path / 'hf.py'}:build", "--mesh", "tp=2"]) == 0
    assert "Plan on mesh (tp=2)" in capsys.readouterr().out
