"""Start-up: one rank's load, engine and teardown written once for every face (runtime.py),
and the launcher that starts ranks for `--nproc` and owns their lifetime (launcher.py)."""
