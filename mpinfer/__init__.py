"""mpinfer: BLOOM-class models served with int8 weights and tensor parallelism.

The package is organised by responsibility (see DESIGN.md): config, dist, checkpoint, plan,
quant, layers, model, loader, generation, tiny, cli. Nothing heavy is imported here.
"""

__version__ = "0.1.0"
