"""Checkpoints and loading: HF checkpoints read slice by slice (hf.py), the pre-sharded int8
format (sharded.py), host-memory accounting (hostmem.py), and putting weights on every rank's
meta model (loader.py). Nothing here runs a forward."""
