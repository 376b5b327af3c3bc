"""`pagoda topology` as users and the main CLI call it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda_daemon.topology import NodeTopology
from pagoda_daemon.topology.cli import main

DAEMON = str(Path(__file__).resolve().parents[2] / "daemon")


def test_json_report(dgx, capsys):
    assert main(["--sysfs-root", str(dgx.root), "--json"]) == 0
    report = NodeTopology.from_dict(json.loads(capsys.readouterr().out))
    assert len(report.gpus) == 8 and report.link(0, 4).type == "SYS"


def test_human_report_shows_tables_and_matrix(pcie_box, capsys):
    assert main(["--sysfs-root", str(pcie_box.root)]) == 0
    out = capsys.readouterr().out
    assert "NUMA  CPUS" in out and "GPUs (from sysfs)" in out
    row = next(line for line in out.splitlines() if line.startswith("GPU4 "))
    assert row.split() == ["GPU4", "SYS", "SYS", "SYS", "SYS", "X", "PIX", "PXB", "PXB"]


def test_human_report_lists_warnings(laptop, capsys):
    (laptop.root / "sys/devices/system/node/node0/meminfo").unlink()
    assert main(["--sysfs-root", str(laptop.root)]) == 0
    out = capsys.readouterr().out
    assert "GPUs: none found" in out
    assert "warnings (the report is partial):" in out and "meminfo is missing" in out


def test_plan_json(dgx, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert main(["--sysfs-root", str(dgx.root), "--plan", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert [(w["rank"], w["gpu"], w["cpus"]) for w in plan["workers"]] == [(0, 4, "28-54"), (1, 5, "28-54")]
    assert plan["kvTransferCpus"] == {"1": 55}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--plan", "--policy", "fast"], "unknown pinning policy"),
        (["--interval", "0"], "--interval must be positive"),
        (["--once"], "--once only makes sense with --publish"),
        (["--gpu-backend", "cuda"], "invalid choice"),
        (["--publish", "--once"], "NODE_NAME is not set"),
        (["--model-cache", "/c"], "--model-cache only makes sense with --publish"),
        *[(["--publish", "--model-cache", "/c", "--model-cache-max-gib", v], "--model-cache-max-gib must be in")
          for v in ("0", "-1", "nan", "inf", "1e300")],
        (["--publish", "--model-cache-max-gib", "lots"], "invalid float value"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, laptop, capsys, monkeypatch):
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert main(["--sysfs-root", str(laptop.root), *argv]) == 2
    assert message in capsys.readouterr().err


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "--sysfs-root" in capsys.readouterr().out


_BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'torch', 'pynvml', 'amdsmi', 'kubernetes'}:
            raise ImportError('blocked for this test: ' + name)
sys.meta_path.insert(0, Block())
"""


def test_module_entry_point_needs_no_torch_nvml_or_kubernetes():
    code = _BLOCKER + (
        "import runpy, sys\n"
        "sys.argv = ['x', '--json']\n"
        "try:\n"
        "    runpy.run_module('pagoda_daemon.topology', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
    )
    env = {**os.environ, "PYTHONPATH": DAEMON}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["cpu"]["logicalCpus"] >= 1


def test_importing_the_package_never_imports_torch():
    code = (
        "import sys\n"
        "import pagoda_daemon.topology, pagoda_daemon.topology.cli, pagoda_daemon.topology.publish\n"
        "import pagoda_daemon.topology.bench_pinning\n"
        "from pagoda_daemon.topology import discover\n"
        "discover('/')\n"
        "bad = sorted(m for m in ('torch', 'kubernetes') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": DAEMON}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr


def test_publish_without_kubernetes_client_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import now fails
    assert main(["--publish", "--once", "--node-name", "n1"]) == 2
    assert "needs the kubernetes client" in capsys.readouterr().err
