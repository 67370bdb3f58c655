"""HTTP server (TGI + OpenAI routes) on rank 0; every rank computes.

    torchrun --nproc-per-node 8 launch/serve.py --config configs/bloom-176b-8x24gb.toml

Also: `mpinfer serve --nproc 2 --model DIR [--port 8080]`. Binds 127.0.0.1 unless
server.host says otherwise. SIGTERM/SIGINT drain in-flight requests, then all ranks exit 0.
"""

import sys

from mpinfer.server.serve import serve_main

if __name__ == "__main__":
    sys.exit(serve_main())
