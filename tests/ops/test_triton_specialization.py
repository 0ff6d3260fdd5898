"""Every `do_not_specialize` name of a Triton kernel is one of its parameters. Compiled Triton
resolves the names when the module is imported (a typo would break every CUDA forward), while
the CPU interpreter ignores them, so this is checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import mambaserve.ops.triton as triton_pkg

KERNEL_DIR = Path(triton_pkg.__file__).parent


def _decorated_kernels():
    for path in sorted(KERNEL_DIR.glob("*.py")):
        for fn in ast.parse(path.read_text()).body:
            if not isinstance(fn, ast.FunctionDef):
                continue
            for dec in fn.decorator_list:
                if isinstance(dec, ast.Call):
                    for kw in dec.keywords:
                        if kw.arg == "do_not_specialize":
                            yield path.name, fn, [ast.literal_eval(e) for e in kw.value.elts]


def test_do_not_specialize_names_are_parameters():
    found = list(_decorated_kernels())
    # the batch-dependent sizes of the prefill kernels, at least
    assert {"_conv_varlen_kernel", "_chunk_state_passing_kernel", "_paged_attention_tiled_kernel"} <= {
        fn.name for _, fn, _ in found}
    for name, fn, names in found:
        params = [a.arg for a in fn.args.args]
        assert set(names) <= set(params), (name, fn.name, set(names) - set(params))
