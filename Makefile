# moco-retrieval: `make run` (the main job) and `make test`. Everything else is set up on demand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch comes first, pinned. pip's default torch wheel on Linux is the CUDA build (it runs on a CPU too): torch and
# its nvidia-* wheels take about 4.4 GB, the whole venv about 6.3 GB. CPU=1 TORCH_INDEX=URL: torch's CPU build from
# PyTorch's CPU wheel index at URL instead (see the README): about 4.5 GB less (nvidia-* 3.2 GB, triton 0.9 GB).
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
TORCH_INDEX ?=
# The extras: everything for the CPU (faiss-cpu), or with GPU=1 faiss-gpu and its CUDA libraries instead; never
# both FAISS builds in one venv (they ship the same `faiss` module): the other one is removed first.
ifeq ($(GPU),1)
EXTRAS ?= gpu,ui,plot,tensorboard,onnx,parquet,heic,raw,watch,dev
OTHER_FAISS := faiss-cpu
else
EXTRAS ?= all,dev
OTHER_FAISS := faiss-gpu faiss-gpu-cu12
endif
comma  := ,
STAMP  := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))

# make run: photos -> train -> export -> index -> serve (see README). Each photo folder has its own directory in
# WORK (the sample: WORK/sample); re-running on the same folder reuses what exists there.
#   PHOTOS=~/Pictures      your photos (default: a generated sample collection)
#   CHECKPOINT=file|NAME   use this pretrained MoCo model as is (no training); NAME: see `moco pretrained`
#   INIT=file|NAME         continue MoCo training from it on your photos
#   PRETRAINED=NAME|none   with PHOTOS and no CHECKPOINT/INIT/MINUTES: the official model used as is when cached
#                          or downloadable (default moco_v2_800ep, into $MOCO_HOME); none: train from scratch
#   MINUTES=10             training time budget (default: 10 on a CPU, the full v2 recipe on a GPU)
PHOTOS ?=
CHECKPOINT ?=
INIT ?=
PRETRAINED ?=
MINUTES ?=
WORK ?= runs/default
HOST ?= 127.0.0.1
PORT ?= 7860
RUN_FLAGS ?=

.PHONY: install run test lint clean bench dist

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
ifeq ($(CPU),1)
	@[ -n "$(TORCH_INDEX)" ] || { echo "CPU=1 needs TORCH_INDEX=URL, PyTorch's CPU wheel index (see the README)" >&2; \
		exit 2; }
	$(BIN)/python -m pip install -q --index-url "$(TORCH_INDEX)" $(TORCH_SPEC)
else
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
endif
	$(BIN)/python -m pip uninstall -q -y $(OTHER_FAISS) 2>/dev/null || true
	# the index, UI, curves, TensorBoard, ONNX and YAML extras (the library alone: pip install moco-retrieval)
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed*
	touch $(STAMP)

install: $(STAMP)

# The command, echoed as one line: the optional flags only when set.
RUN_CMD = $(strip $(BIN)/moco run $(PHOTOS) --work $(WORK) $(if $(CHECKPOINT),--checkpoint $(CHECKPOINT)) \
	$(if $(INIT),--init $(INIT)) $(if $(PRETRAINED),--pretrained $(PRETRAINED)) \
	$(if $(MINUTES),--minutes $(MINUTES)) --host $(HOST) --port $(PORT) $(RUN_FLAGS))

run: install
	$(RUN_CMD)

# The browser test drives Debian's chromium through Playwright (never `playwright install`).
CHROMIUM ?= /usr/bin/chromium
# chromium and what it depends on are installed as `apt-get install chromium` does it (a dependency that needs a newer
# version of an installed package upgrades that package, nothing else is upgraded); the package lists are updated first
# only when apt does not know chromium. What it installs and upgrades is said before it starts.
APT_INSTALL := apt-get install -y -qq chromium
$(CHROMIUM):
	@echo "chromium is missing: installing it and what it depends on for the browser test ($(APT_INSTALL))"
	@command -v apt-get >/dev/null || { echo "no apt-get here: install chromium yourself, or set" \
		"CHROMIUM=/path/to/chromium" >&2; exit 1; }; \
	SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	apt-cache show chromium >/dev/null 2>&1 || { echo "apt does not know chromium yet: apt-get update first"; \
		$$SUDO apt-get update -qq; }; \
	upgrades=$$(apt-get -s install chromium | sed -n 's/^Inst \([^ ]*\) \[.*/\1/p' | tr '\n' ' '); \
	if [ -n "$$upgrades" ]; then echo "chromium needs newer versions of $$upgrades(upgraded with it)"; fi; \
	$$SUDO env DEBIAN_FRONTEND=noninteractive $(APT_INSTALL) || { echo "installing chromium failed: install it" \
		"yourself, or set CHROMIUM=/path/to/chromium" >&2; exit 1; }

# The test files run on TEST_WORKERS processes (pytest-xdist; each file stays on one, so its fixtures are built
# once): about 1.3x faster than one process on 2 cores. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: install $(CHROMIUM)
	@echo "make test: about 15 minutes on 2 cores (about 25 with both cores busy); PYTEST_ARGS='-m \"not slow\"'" \
		"leaves out the slow ones"
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# make bench: every benchmark under bench/ (about 1.5 hours on 2 cores), then BENCHMARKS.md from the results.
# gpu_check.py needs a CUDA device and is skipped (with a message) without one.
BENCH_SCRIPTS ?= train_throughput layout fashion_mnist embed_throughput search ui_load gpu_check
bench: install
	$(BIN)/python -m pip install -q -e ".[dev,bench]"
	@for s in $(BENCH_SCRIPTS); do \
		if [ $$s = gpu_check ] && ! $(BIN)/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then \
			echo "bench: skipping gpu_check (no CUDA device)"; continue; fi; \
		echo "bench: $$s"; $(BIN)/python bench/$$s.py || exit 1; \
	done
	$(BIN)/python bench/report.py

# make dist: the wheel to install without a clone, offline (only this project: its dependencies come from where pip
# finds them): dist/moco_retrieval-VERSION-py3-none-any.whl, then pip install "dist/moco_retrieval-...whl[index,ui]"
DIST ?= dist
dist: install
	rm -rf $(DIST) build
	$(BIN)/python -c "import setuptools" 2>/dev/null || $(BIN)/python -m pip install -q "setuptools>=68"
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation -w $(DIST) .
	rm -rf build

lint: install
	$(BIN)/ruff check .
	$(BIN)/hadolint Dockerfile

clean:
	rm -rf $(VENV) runs .pytest_cache dist build
