"""The per-device launch-parameter table (`mambaserve.ops.triton.tuning`): lookups by compute
capability, overrides, and that the launchers read their knobs from it (none takes a tuning
keyword, every knob of an entry is read by the launcher that owns the entry)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch
from triton_env import DEV, require_interpreter  # before anything imports triton

import mambaserve.ops.triton as triton_pkg
from mambaserve.ops.triton import tuning
from mambaserve.ops.triton.activation import _relu2_kernel, relu2_triton

require_interpreter(_relu2_kernel)

KERNEL_DIR = Path(triton_pkg.__file__).parent
TUNING_WORDS = ("block", "warps", "stages", "lookahead", "unroll", "split", "_stop_after")


def test_cpu_and_untuned_devices_get_the_default(monkeypatch):
    assert tuning.table_for("cpu") is tuning.DEFAULT
    assert tuning.config("ssd", torch.device("cpu")) == dict(tuning.DEFAULT["ssd"])
    monkeypatch.setattr(tuning, "_cuda_capability", lambda index: (9, 0))
    assert tuning.table_for("cuda:0") is tuning.BY_CAPABILITY[(9, 0)] is tuning.SM90
    monkeypatch.setattr(tuning, "_cuda_capability", lambda index: (8, 6))
    assert tuning.table_for(torch.device("cuda", 1)) is tuning.DEFAULT


def test_every_table_has_the_default_kernels_and_knobs():
    for cap, table in tuning.BY_CAPABILITY.items():
        assert set(table) == set(tuning.DEFAULT), cap
        for kernel, knobs in table.items():
            assert set(knobs) == set(tuning.DEFAULT[kernel]), (cap, kernel)


def test_override_applies_nests_and_restores():
    base = tuning.config("ssd", "cpu")
    with tuning.override("ssd", block_m_scan=32, num_warps_scan=8):
        cfg = tuning.config("ssd", "cpu")
        assert cfg["block_m_scan"] == 32 and cfg["num_warps_scan"] == 8
        assert cfg["block_p_state"] == base["block_p_state"]
        with tuning.override("ssd", block_m_scan=16):
            assert tuning.config("ssd", "cpu")["block_m_scan"] == 16
            assert tuning.config("ssd", "cpu")["num_warps_scan"] == 8
        assert tuning.config("ssd", "cpu")["block_m_scan"] == 32
        assert tuning.config("relu2", "cpu") == dict(tuning.DEFAULT["relu2"])  # other kernels
    assert tuning.config("ssd", "cpu") == base


def test_override_is_undone_on_error():
    with pytest.raises(RuntimeError), tuning.override("relu2", block=64):
        raise RuntimeError
    assert tuning.config("relu2", "cpu")["block"] == tuning.DEFAULT["relu2"]["block"]


def test_override_is_local_to_its_thread():
    seen = []
    with tuning.override("relu2", block=64):
        t = threading.Thread(target=lambda: seen.append(tuning.config("relu2", "cpu")["block"]))
        t.start()
        t.join()
    assert seen == [tuning.DEFAULT["relu2"]["block"]]


def test_unknown_names_are_rejected():
    with pytest.raises(KeyError, match="no tuning entry"), tuning.override("flash", block=64):
        pass
    with pytest.raises(TypeError, match="block_q"), tuning.override("ssd", block_q=64):
        pass
    with pytest.raises(KeyError, match="no tuning entry"):
        tuning.config("flash", "cpu")


@pytest.fixture
def tuning_env(monkeypatch):
    """Set MAMBASERVE_TUNING for one test (read again; the process's value restored after)."""
    def set_env(text):
        monkeypatch.setenv(tuning.TUNING_ENV, text)
        tuning.env_values.cache_clear()
    yield set_env
    monkeypatch.delenv(tuning.TUNING_ENV, raising=False)
    tuning.env_values.cache_clear()


def test_the_environment_sets_knobs_under_the_overrides(tuning_env):
    tuning_env(" relu2.block=64, ssd.num_warps_scan=8 ,relu2.num_warps=None,")
    assert tuning.config("relu2", "cpu") == {"block": 64, "num_warps": None}
    ssd = tuning.config("ssd", "cpu")
    assert ssd["num_warps_scan"] == 8
    assert ssd["block_p_state"] == tuning.DEFAULT["ssd"]["block_p_state"]
    assert tuning.config("fp8_gemv", "cpu") == dict(tuning.DEFAULT["fp8_gemv"])
    with tuning.override("relu2", block=16):  # an override wins over the environment
        assert tuning.config("relu2", "cpu") == {"block": 16, "num_warps": None}
    x = torch.randn(300, device=DEV)  # and the launch takes the environment's block
    tuning_env("relu2.block=48")
    with pytest.raises(Exception):  # noqa: B017  tl.arange needs a power of two
        relu2_triton(x)
    tuning_env("relu2.block=32,relu2.num_warps=1")
    assert torch.equal(relu2_triton(x), torch.relu(x).square())
    tuning_env("")
    assert tuning.config("relu2", "cpu") is tuning.DEFAULT["relu2"]


@pytest.mark.parametrize("text,message", [
    ("relu2", "'relu2' is not kernel.knob=value"),
    ("block=64", "'block=64' is not kernel.knob=value"),
    ("flash.block=64", "no tuning entry 'flash'"),
    ("relu2.block_q=64", "kernel 'relu2' has no knob 'block_q'; its knobs: ['block', "),
    ("relu2.block=sixty", "'relu2.block=sixty': the value is not a Python literal"),
])
def test_a_bad_environment_is_one_line(tuning_env, text, message):
    tuning_env(text)
    with pytest.raises(ValueError, match="MAMBASERVE_TUNING: ") as err:
        tuning.config("relu2", "cpu")
    assert message in str(err.value) and "\n" not in str(err.value)


def test_launchers_read_the_table():
    """An override reaches the launch: a block the kernel cannot take is refused by Triton."""
    x = torch.randn(40, device=DEV)
    with tuning.override("relu2", block=16, num_warps=1):
        assert torch.equal(relu2_triton(x), torch.relu(x).square())
    with pytest.raises(Exception), tuning.override("relu2", block=48):  # noqa: B017
        relu2_triton(x)  # tl.arange needs a power of two


def _launchers():
    for path in sorted(KERNEL_DIR.glob("*.py")):
        for fn in ast.parse(path.read_text()).body:
            if isinstance(fn, ast.FunctionDef) and fn.name.endswith("_triton"):
                yield path, fn


def test_no_launcher_takes_a_tuning_keyword():
    found = list(_launchers())
    assert len(found) >= 10
    for path, fn in found:
        args = fn.args
        names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        bad = [n for n in names if any(w in n for w in TUNING_WORDS)]
        assert not bad, (path.name, fn.name, bad)


def test_every_knob_is_read_by_its_launcher():
    """Each entry is read (`tuning.config("<kernel>", ...)`) by one kernel module, which names
    every knob of the entry."""
    readers: dict[str, list[Path]] = {}
    for path in sorted(KERNEL_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "config" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "tuning"):
                arg = node.args[0]
                kernels = ([arg.value] if isinstance(arg, ast.Constant)
                           else [v.value for v in ast.walk(arg) if isinstance(v, ast.Constant)])
                for k in kernels:
                    readers.setdefault(k, []).append(path)
    assert set(readers) == set(tuning.DEFAULT), set(readers) ^ set(tuning.DEFAULT)
    for kernel, paths in readers.items():
        assert len(set(paths)) == 1, (kernel, paths)
        consts = {n.value for n in ast.walk(ast.parse(paths[0].read_text()))
                  if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        missing = set(tuning.DEFAULT[kernel]) - consts
        assert not missing, (kernel, paths[0].name, missing)
