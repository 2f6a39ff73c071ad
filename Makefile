# The two commands of the README, plus their parts (services: Prometheus, Pushgateway, S3 test server, helm, kubectl).
#   make run    set up .venv and run the embedded default (SuPerFed-MM on mnist5k, 20 clients)
#   make test   set up .venv with the test tools, the test services and the container image, then run the tests
.PHONY: run test setup setup-test services images clean bench-peers docs docs-serve docs-tools

# Two test processes (pytest-xdist): the suite took 31 min in two on 2 cores (2026-11-29, once set up); the federation tests run on one worker.
# Each worker's torch gets its share of the cores (tests/conftest.py); the federation tests share one worker
# (tests/federation/conftest.py, --dist loadgroup); the 25 slowest tests are listed at the end.
PYTEST_ARGS ?= -n 2 --dist loadgroup --durations=25

run: setup
	.venv/bin/fedpipe run

test: setup-test services images
	.venv/bin/python -m pytest $(PYTEST_ARGS)

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh --test

services:
	scripts/test-services.sh
	scripts/get-helm.sh

# The container image (podman/buildah), pushed to a registry on loopback and pulled back (scripts/build-images.sh).
images:
	scripts/build-images.sh

clean:
	rm -rf .venv runs .pytest_cache .hypothesis

# The documentation site (mkdocs.yml, docs/; docs/docs.md says how it is made): the generated pages rewritten
# from the code, then the site built into build/site with --strict, or served on http://127.0.0.1:8000.
docs: setup-test docs-tools
	.venv/bin/python scripts/gen_docs.py
	.venv/bin/mkdocs build --strict

docs-serve: setup-test docs-tools
	.venv/bin/python scripts/gen_docs.py
	.venv/bin/mkdocs serve

# Graphviz and Chromium (apt), which draw the site's pictures
docs-tools:
	scripts/test-services.sh --docs

# fedpipe's engines beside a bare PyTorch loop and Flower's simulation (its own venv in .cache/bench-flower), ~15 min on 2 cores.
bench-peers: setup
	.venv/bin/python benchmarks/peers.py --out benchmarks/results/peers.md
