# `make test` and `make demo` work on a fresh machine: they create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export PJRT_DEVICE := CPU

.PHONY: test demo bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[xla,test]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) scripts/bench.py --size-gb 1 --tensors 300 --dir /tmp/nxd_ckpt_bench --repeat 3 --out bench_out/bench_1gb.json

clean:
	rm -rf $(VENV) demo_out bench_out .pytest_cache
