"""Shard-and-save: quantize an HF checkpoint once into one int8 safetensors file per rank.

    python launch/shard.py --model /data/bloom --tp 8 --out /data/bloom-int8-tp8 [--quant int8]

(the same as `mpinfer shard ...`; a single process, no torchrun needed).
"""

import sys

from mpinfer.cli import shard_main

if __name__ == "__main__":
    sys.exit(shard_main(sys.argv[1:]))
