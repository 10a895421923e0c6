"""Make PyPI's torchvision importable beside the CPU build of torch (a set-up step of scripts/dev.sh).

PyPI's torchvision wheels link their C ops (nms, roi_align, ...) against CUDA torch; beside the
CPU torch those ops cannot load, and torchvision 0.28 then fails on import, registering fake
kernels for ``torchvision::nms``/``qnms`` that do not exist. timm and transformers need only its
Python parts (``FrozenBatchNorm2d``, transforms), so those two registrations are made conditional
on the ops being there, as every other registration in that file already is. Idempotent.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys

GUARD = '''
def _register_fake_if_loaded(name):  # added by tvmbridge's scripts/torchvision_cpu.py
    def wrapper(fn):
        return torch.library.register_fake(name)(fn) if torchvision.extension._has_ops() else fn
    return wrapper
'''


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision is not installed: nothing to do")
        return 0
    path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    if "_register_fake_if_loaded" in text:
        return 0
    anchor = "@functools.lru_cache(None)\ndef get_meta_lib():"
    if anchor not in text or '@torch.library.register_fake("torchvision::' not in text:
        print(f"warning: {path} has an unexpected form; left as it is", file=sys.stderr)
        return 0
    text = text.replace(anchor, GUARD.lstrip("\n") + "\n\n" + anchor, 1)
    text = text.replace('@torch.library.register_fake("torchvision::', '@_register_fake_if_loaded("torchvision::')
    path.write_text(text)
    print(f"guarded torchvision's fake-kernel registrations in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
