"""Tools for the people who work on mpinfer: benchmarks, the random-checkpoint maker, GPU
diagnostics. They may import anything in the package; nothing in the package imports them (the
CLI names `make-tiny` and `bench` by module path). Run from a checkout: the benchmarks read the
published architectures in configs/arch/ and write under bench/results/.
"""
