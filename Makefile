# Two commands do all the set-up on a fresh machine:
#   make demo   install, make a tiny random BLOOM, generate with 2 tensor-parallel ranks on CPU
#   make test   install, run the test suite (what CI runs)
# and two more for the demo model: `make serve` (the HTTP server) and `make repl`.
PYTHON ?= python3
# From your pip index: PyPI's torch 2.13.0 on Linux is the CUDA build (CI's local index has the
# CPU one); for the CPU build from PyPI's side write
#   make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" demo
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
DEMO := --nproc 2 --config configs/tiny-cpu.toml
ARGS ?=  # more flags for `make serve` / `make repl`, e.g. ARGS="--port 8081"

.PHONY: install demo serve repl test clean

# `make demo` needs only what running needs; `make test` adds the test clients on top.
$(BIN)/mpinfer: pyproject.toml
	@echo "== a virtual environment in $(VENV)"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "== $(TORCH) first (an unpinned dependency would pull a multi-GB CUDA build)"
	$(BIN)/pip install -q $(TORCH)
	@echo "== mpinfer and what it needs to run (setuptools prints a BuildBackendWarning)"
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-extras: $(BIN)/mpinfer
	@echo "== the test extras: transformers, the client tools the suite drives (a few minutes)"
	$(BIN)/pip install -q -e '.[test]'
	# Hugging Face's text-generation client (a test client) pins huggingface_hub<1.0, which
	# transformers 5 cannot use; it works with the newer hub, so it goes in without its pins.
	$(BIN)/pip install -q --no-deps text-generation==0.7.0
	# Triton's interpreter runs the GPU kernels on a CPU (tests/test_kernels.py). A CUDA build
	# of torch brings its own Triton: only a CPU build gets this one.
	$(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda is not None)" && \
	    $(BIN)/pip install -q triton==3.9.0 || true
	touch $@

install: $(BIN)/mpinfer

out/tiny/config.json: | install
	@echo "== a tiny random BLOOM in out/tiny"
	$(BIN)/mpinfer make-tiny out/tiny --layers 2 --hidden 64 --heads 4 --vocab 1024

demo: install out/tiny/config.json
	$(BIN)/mpinfer generate $(DEMO) --prompt "The capital of France is" --max-new-tokens 16

serve: install out/tiny/config.json
	@echo "The demo model on http://127.0.0.1:8080 (Ctrl-C stops it). From another terminal:"
	@echo "  curl -s 127.0.0.1:8080/generate --json '{\"inputs\": \"Hello\", \"parameters\": {\"max_new_tokens\": 16}}'"
	$(BIN)/mpinfer serve $(DEMO) $(ARGS)

repl: install out/tiny/config.json
	$(BIN)/mpinfer repl $(DEMO) $(ARGS)

test: $(VENV)/.test-extras
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) out
