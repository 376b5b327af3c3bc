"""Layouts a model cannot be split into are refused in one line, before any rank starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagoda_daemon.distributed.layout import check_layout
from pagoda_daemon.distributed.parallel_state import TensorParallel
from pagoda_daemon.models.loader import load_config


@pytest.mark.parametrize(("arch", "tensor", "expert", "message"), [
    ("llama", 3, 1, r"attention heads \(4\) is not divisible by tensor_parallel_size × expert_parallel_size = 3"),
    ("llama", 1, 2, "expert_parallel_size 2 needs a mixture-of-experts model"),
    ("qwen3_moe", 1, 3, r"attention heads \(4\) is not divisible by tensor_parallel_size × expert_parallel_size = 3.*number of experts \(8\)"),
    ("qwen3_moe", 8, 1, r"heads \(4\) is not divisible by tensor_parallel_size × expert_parallel_size = 8"),
])
def test_a_layout_the_model_cannot_take_is_refused(tiny_models, arch, tensor, expert, message):
    with pytest.raises(ValueError, match=message):
        check_layout(load_config(tiny_models[arch]), tensor, expert)


@pytest.mark.parametrize(("arch", "tensor", "expert"), [("llama", 4, 1), ("qwen3_moe", 2, 2), ("qwen3_moe", 1, 4)])
def test_the_layouts_the_tests_run_are_accepted(tiny_models, arch, tensor, expert):
    check_layout(load_config(tiny_models[arch]), tensor, expert)


def test_pagoda_serve_refuses_a_bad_layout_in_one_line_before_starting(tiny_models):
    proc = subprocess.run([sys.executable, "-m", "pagoda_daemon", "serve", tiny_models["llama"],
                           "--expert-parallel-size", "2", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "pagoda serve: expert_parallel_size 2 needs a mixture-of-experts model; this one has no experts"]


def test_expert_groups_must_divide_the_ranks():
    with pytest.raises(ValueError, match="expert-parallel size 3 does not divide the 4 ranks"):
        TensorParallel(0, 4, None, expert_groups=3)
    tp = TensorParallel(5, 8, None, expert_groups=2)
    assert tp.expert_group == 1 and tp.expert_slicing == (1, 4) and tp.local_experts(8) == (4, 4)
