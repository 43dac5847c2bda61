# Both targets do all set-up first (idempotent): Debian packages, kernel headers for bcc, .venv.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup test demo demo-cluster lint typecheck bench-quick

setup:
	@bash scripts/setup.sh

lint: setup
	$(VENV)/bin/ruff check trainguard agent trainer tui tests bench examples

typecheck: setup
	MYPY=$(VENV)/bin/mypy bash scripts/typecheck.sh

test: setup lint typecheck
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup tests

demo: setup
	$(VENV)/bin/trainguard demo

# Two agents + etcd on loopback, one job spanning both; one node is killed, the job goes on.
demo-cluster: setup
	$(PY) -m trainguard.agent.cluster.demo
