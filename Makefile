# gspmd-tf developer tasks. Everything runs in .venv, which the first target creates.
# `make test` on a machine with only python3 (and PyPI) sets itself up.
# make test TESTS=tests/test_mesh.py PYTEST_ARGS="-k groups" runs a subset.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYX := $(wildcard csrc/*.pyx csrc/*.pxd)
EXT_STAMP := build/.extensions
BENCHMARKS := $(wildcard benchmarks/*.py)
TESTS ?= tests

.PHONY: venv build test test-long demo bench clean distclean

venv: $(VENV)/.installed

# requirements-nodeps.txt: packages whose declared dependencies would pull the full
# `tensorflow` beside tensorflow-cpu (keras-hub, tf-keras), installed without them.
$(VENV)/.installed: requirements.txt requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -r requirements-nodeps.txt
	touch $@

# The stamp depends on the Cython sources, so editing a .pyx rebuilds its extension.
$(EXT_STAMP): $(VENV)/.installed setup.py $(PYX)
	$(PY) setup.py build_ext --inplace
	mkdir -p $(dir $@) && touch $@

build: $(EXT_STAMP)

test: build
	$(PY) -m pytest -q -x $(TESTS) $(PYTEST_ARGS)

# The cases marked @pytest.mark.long too (slow model-scale checks kept out of `make test`).
test-long: build
	GSPMD_TF_LONG=1 $(PY) -m pytest -q -x $(TESTS) $(PYTEST_ARGS)

demo: build
	$(PY) -m gspmd_tf.demo

bench: build
	@echo "benchmark scripts (run each with $(PY) benchmarks/NAME.py --help):"
	@for script in $(BENCHMARKS); do echo "  $$script"; done

clean:
	rm -rf build *.egg-info .pytest_cache .hypothesis
	rm -f gspmd_tf/_*.so $(patsubst %.pyx,%.c,$(wildcard csrc/*.pyx))
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
