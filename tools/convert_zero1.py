#!/usr/bin/env python3
"""Change the data-parallel size of a ZeRO-1 optimizer checkpoint (neuronx-distributed's converter flags).

    python tools/convert_zero1.py --input_dir ckpts/step_1000 --output_dir ckpts/step_1000_dp4 \
        --convert_to_sharded --dp_size 4 --num_workers 4

Same as `nxd-ckpt convert-zero1` and `nxd_convert_zero_checkpoints`.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nxd_ckpt.cli import convert_zero1_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(convert_zero1_main())
