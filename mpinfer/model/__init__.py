"""The model layer: BLOOM on tensor-parallel layers (bloom.py, layers.py), the matmul methods
(quant.py), the KV cache and attention over a step's flat batch (attention.py), the Triton
kernels (kernels/), which tensor is split how (sharding.py) and the GPU memory planner
(memory.py). Nothing here knows files, requests or HTTP."""
