"""GPU diagnostics kept from the kernel work (each a `python3 -m mpinfer.tools.diag.NAME` on a
GPU machine, printing a markdown table): launch_floor (what one launch costs), access_pattern
(the W8A16 tile order against a plain read), grid_sync (a grid-wide barrier against a launch
boundary). docs/performance.md has what they found.
"""
