"""Tune a built-in model's TVM kernels with MetaSchedule (the same as ``tvmbridge tune``).

    python scripts/tune.py --work-dir tuning/bert --trials-per-task 64          # BertLayer training
    python scripts/tune.py --work-dir tuning/bert --batch 8 --seq 128 --max-trials 2000
    python scripts/tune.py --work-dir tuning/bert-infer --inference --model bert-mlm
Then: add_tvm_dispatch(model, inputs, tuning_db="tuning/bert").
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tvmbridge.tools.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["tune", *sys.argv[1:]]))
