"""Repository layout rules and the `pagoda` command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagoda_daemon.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_source_roots_shadow_nothing():
    """Running from the repository root puts it on sys.path: no top-level folder may be a
    package, or `operator/` would shadow the standard library's `operator`."""
    for folder in ("operator", "daemon", "kernels", "crds", "charts", "e2e", "docs"):
        assert not (ROOT / folder / "__init__.py").exists(), folder
    code = "import operator, sys; print(operator.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "site-packages" not in out.stdout and str(ROOT) not in out.stdout, out.stdout


def test_operator_extra_never_needs_torch():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert not any(dep.startswith("torch") for dep in extras["operator"])
    assert any(dep.startswith("torch") for dep in extras["daemon"])


def test_importing_the_package_and_cli_does_not_import_torch():
    code = "import pagoda_daemon, pagoda_daemon.cli, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pagoda_operator_runs_without_the_daemons_packages():
    """The operator image has the `operator` extra only; `pagoda operator` goes through the same
    command line, which builds every subcommand's flags (`pagoda serve`'s included). With the
    daemon's own packages made unimportable, its parser must still come up."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    operator_deps = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in extras["operator"]}
    blocked = sorted({"torch", "triton", "transformers", "safetensors", "tokenizers", "fastapi", "starlette",
                      "uvicorn", "h11", "pydantic", "zmq", "msgpack", "opentelemetry", "numpy"} - operator_deps)
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)")
sys.meta_path.insert(0, Block())
from pagoda_daemon.cli import main
sys.exit(main(["operator", "--help"]))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--admission-port" in out.stdout


@pytest.mark.parametrize(("argv", "index"), [
    (["bench", "serve", "--base-url", "x"], 0),
    (["--log-level", "DEBUG", "operator", "--help"], 2),
    (["--log-format=json", "topology"], 1),
    (["serve", "/m", "--served-model-name", "bench"], 0),  # a serve: not delegated to `bench`
    (["--help"], None),
    ([], None),
])
def test_the_subcommand_is_found_in_its_place_only(argv, index):
    from pagoda_daemon.cli import DELEGATED, _subcommand_index

    assert _subcommand_index(argv) == index
    assert (index is not None and argv[index] in DELEGATED) == (argv[:1] == ["bench"] or "operator" in argv
                                                                or "topology" in argv)


def test_generate_with_a_tiny_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    rc = main(["generate", "--tiny", "qwen3", "--prompt", "Hello", "--max-tokens", "5", "--numa-policy", "none",
               "--kv-cache-memory-bytes", str(8 << 20)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "prompt: 'Hello'" in out and "5 tokens, finish_reason=length" in out
    assert (tmp_path / "tiny-models" / "qwen3" / "config.json").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "/nonexistent/model"], "does not exist"),
        (["generate"], "give a MODEL_DIR or --tiny"),
    ],
)
def test_generate_bad_input_is_a_readable_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_generate_bad_sampling_value_is_a_readable_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    assert main(["generate", "--tiny", "qwen3", "--max-tokens", "0", "--numa-policy", "none",
                 "--kv-cache-memory-bytes", str(8 << 20)]) == 2
    assert "max_tokens must be at least 1" in capsys.readouterr().err


def test_demo_serves_and_answers_through_the_openai_client(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGODA_CACHE", str(tmp_path))
    assert main(["demo", "--arch", "qwen3"]) == 0
    out = capsys.readouterr().out
    assert "streamed in" in out and "same text: True" in out
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny-qwen3"} 2.0' in out
