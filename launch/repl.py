"""Interactive generation REPL on rank 0's terminal; every rank computes.

    torchrun --nproc-per-node 8 launch/repl.py --config configs/bloom-176b-8x24gb.toml

Also: `mpinfer repl --nproc 2 --model DIR`, or `mpinfer repl --url http://127.0.0.1:8080` to
attach to a running server. Piped stdin works too: one prompt per line.
"""

import sys

from mpinfer.repl import repl_main

if __name__ == "__main__":
    sys.exit(repl_main())
