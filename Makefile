# Two entry points: `make run` (set up and serve the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= default

.PHONY: setup run test lint fast-blas browser clean

# The pip steps are quiet (-q): the echo lines say what each installs, since the first one takes minutes.
$(STAMP): pyproject.toml
	@echo "== setting up $(VENV) (first run: a few minutes; later runs skip this)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "== upgrading pip"
	$(PY) -m pip install -q --upgrade pip
	@echo "== installing mlx-kvserve and its dependencies (MLX, mlx-lm, the test tools): the longest step"
	$(PY) -m pip install -q -e '.[test]'
	@echo "== installing the vision towers (mlx-vlm, Pillow)"
	# the vision towers (docs/vision.md): mlx-vlm without its audio/video/training dependencies
	$(PY) -m pip install -q --no-deps 'mlx-vlm==0.7.10' 'Pillow>=10.3'
	touch $(STAMP)
	@echo "== setup done"

# Debian/Ubuntu: install OpenBLAS so MLX's float32 path is fast (best effort; never fails setup).
fast-blas:
	@echo "== checking for OpenBLAS (Debian/Ubuntu; fast float32 on the CPU)"
	@bash scripts/install.sh openblas || true

# Debian/Ubuntu: headless Chromium for the /ui browser tests (best effort; they skip without it, fail where CI=true).
browser:
	@echo "== checking for headless Chromium (the /ui browser tests)"
	@bash scripts/install.sh chromium || true

setup: $(STAMP) fast-blas browser

run: setup
	@echo "== starting the server: the first start fetches and converts $(MODEL) (progress below)"
	$(VENV)/bin/mlx-kvserve run --model $(MODEL) --host $(HOST) --port $(PORT)

test: setup
	$(PY) -m mlx_kvserve.cpu.blas_exec $(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check mlx_kvserve tests scripts
	$(VENV)/bin/ruff format --check mlx_kvserve tests scripts

clean:
	rm -rf $(VENV) .pytest_cache
