"""The bridge differentiates with its own gradient table: TVM's registry stays as TVM made it, so
another user of ``relax.transform.Gradient`` in the process gets TVM's gradients."""
from __future__ import annotations

import subprocess
import sys
import textwrap

from tvmbridge.passes.gradients import GRADIENTS, gradient

SCRIPT = textwrap.dedent('''
    import torch
    import tvm
    from tvm import relax
    from tvm.script import relax as R

    @tvm.script.ir_module
    class Plain:
        @R.function
        def main(x: R.Tensor((2, 3, 8, 8), "float32"), w: R.Tensor((4, 3, 3, 3), "float32"),
                 i: R.Tensor((2,), "int64")) -> R.Tensor((), "float32"):
            with R.dataflow():
                a = R.nn.relu(R.nn.conv2d(x, w))
                b = R.nn.max_pool2d(a, (2, 2))
                c = R.maximum(R.abs(b), R.minimum(b, R.const(0.5, "float32")))
                d = R.take(c, i, axis=0)
                e = R.split(d, 2, axis=1)
                f = R.where(R.greater(e[0], e[1]), e[0], e[1])
                out = R.sum(f)
                R.output(out)
            return out

    def adjoint_text():
        return relax.transform.Gradient("main")(Plain)["main_adjoint"].script()

    before = adjoint_text()
    import tvmbridge
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
    tvmbridge.add_tvm_dispatch(model, (torch.randn(2, 3, 8, 8),), verify=False)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert model._tvm_dispatch.variants, "nothing compiled"
    print("SAME" if adjoint_text() == before else "CHANGED")
''')


def test_tvm_gradients_are_tvms_after_the_bridge_compiles(tmp_path) -> None:
    script = tmp_path / "registry.py"  # TVMScript reads its source from a file
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "SAME"


def test_a_second_gradient_for_one_op_is_an_error() -> None:
    name = next(iter(GRADIENTS))
    try:
        gradient(name)(lambda *a: [])
    except ValueError as exc:
        assert name in str(exc)
    else:
        raise AssertionError("a duplicate gradient registration was accepted")
    assert GRADIENTS[name].__name__ != "<lambda>"
