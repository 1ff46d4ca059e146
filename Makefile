# moco-retrieval: `make run` (the main job) and `make test`. Everything else is set up on demand.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch comes first, pinned (CPU build here; on a CUDA machine set TORCH_SPEC to the CUDA build you want).
TORCH_SPEC ?= torch==2.14.1 torchvision==0.29.1
STAMP  := $(VENV)/.installed

# make run: train on PHOTOS (default: a generated sample collection).
PHOTOS ?=
RUN    ?= runs/default
SAMPLE := sample_photos
TRAIN_FLAGS ?= --preset v2 --arch resnet18 --small-stem --image-size 64 --batch-size 64 --queue-size 4096 --time-budget 3

.PHONY: install run test lint clean sample

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
ifeq ($(GPU),1)
	# faiss-cpu and faiss-gpu ship the same `faiss` module: never both installed
	$(BIN)/python -m pip uninstall -q -y faiss-cpu
	$(BIN)/python -m pip install -q --force-reinstall --no-deps "faiss-gpu-cu12>=1.13,<1.16"
endif
	touch $(STAMP)

install: $(STAMP)

sample: install
	@test -d $(SAMPLE) || $(BIN)/moco sample $(SAMPLE)

run: install
	@if [ -z "$(PHOTOS)" ]; then $(MAKE) --no-print-directory sample; fi
	@if [ -f "$(RUN)/checkpoint.pt" ]; then \
		$(BIN)/moco train --out $(RUN) --resume; \
	else \
		$(BIN)/moco train "$(if $(PHOTOS),$(PHOTOS),$(SAMPLE))" --out $(RUN) $(TRAIN_FLAGS); \
	fi

# The browser test drives Debian's chromium through Playwright (never `playwright install`).
CHROMIUM ?= /usr/bin/chromium
$(CHROMIUM):
	@echo "installing chromium for the browser test (apt-get)"
	@if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium; \
	else sudo apt-get update -qq && sudo apt-get install -y -qq chromium; fi

test: install $(CHROMIUM)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(SAMPLE) runs .pytest_cache
