# Two commands do all the set-up on a fresh machine:
#   make demo   install, make a tiny random BLOOM, generate with 2 tensor-parallel ranks on CPU
#   make test   install, run the test suite (what CI runs)
PYTHON ?= python3
# The CPU build by default; on a GPU host: make TORCH="torch==2.13.0 --index-url ..." install
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test clean

$(BIN)/mpinfer: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: an unpinned dependency would otherwise pull a multi-GB CUDA build.
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	# Hugging Face's text-generation client (a test client) pins huggingface_hub<1.0, which
	# transformers 5 cannot use; it works with the newer hub, so it goes in without its pins.
	$(BIN)/pip install -q --no-deps text-generation==0.7.0
	touch $@

install: $(BIN)/mpinfer

out/tiny/config.json: | install
	$(BIN)/mpinfer make-tiny out/tiny --layers 2 --hidden 64 --heads 4 --vocab 1024

demo: install out/tiny/config.json
	OMP_NUM_THREADS=1 $(BIN)/torchrun --nproc-per-node 2 launch/generate.py \
		--config configs/tiny-cpu.toml --prompt "The capital of France is" --max-new-tokens 16

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) out
