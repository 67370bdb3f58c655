"""mpinfer: BLOOM-class models served with int8 weights and tensor parallelism.

The package's layers, each importing only those below it (docs/architecture.md has the map):
faces (cli, serve, routes, api, chat, repl) -> runtime (runtime, launcher) -> engine (engine,
runner, sampling, detok) -> loading (loader, sharded, checkpoint, sharding, memory, hostmem) ->
model (model, layers, quant, kernels/) -> base (config, dist, extras). The tools (mpinfer.tools:
benchmarks, make-tiny, diagnostics) import the product; the product never imports them. Nothing
heavy is imported here.
"""

from importlib.metadata import PackageNotFoundError, version

try:  # one version string: the installed package's (pyproject.toml)
    __version__ = version("mpinfer")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+source"
