"""One-shot generation on N tensor-parallel ranks; rank 0 prints the completions.

    torchrun --nproc-per-node 2 launch/generate.py --model DIR --prompt "The capital of France is" \
        --max-new-tokens 32 [--greedy] [--json] [--quant int8|llm.int8|none] [--dtype ...]

Without torchrun: `mpinfer generate --nproc 2 --model DIR ...` starts the ranks itself.
"""

import sys

from mpinfer.cli import generate_main

if __name__ == "__main__":
    sys.exit(generate_main())
