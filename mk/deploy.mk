# Deployment: images, Kubernetes job rendering, chart tests. Included by the top-level Makefile.
#   make base-image                       local Python base image (debootstrap + docker import; no registry pulls)
#   make images                           learner + rollout-server CPU images on the local base (CPU torch, light
#                                         extras), tagged <IMAGE_TAG>-cpu: rollout-matching/learner:0.1.0-cpu
#   make images IMAGE_BASE=official       the GPU images on the official vLLM base (needs a registry), tagged
#                                         <IMAGE_TAG>: rollout-matching/learner:0.1.0 (what the chart runs)
#   make job CONFIG=configs/x.yaml        render the Jobs and submit them (DRY_RUN=1: print the YAML instead)
#   make presets                          write presets/<name>.yaml from presets/<name>.values.yaml, and the
#                                         root values-6v2.yaml, values-3v1.yaml, values-colocate.yaml
#   make chart-test                       chart lint/render + job rendering checks (no Docker needed)

.PHONY: base-image images job job-config chart-test docker-context presets

DOCKER ?= docker
IMAGE_TAG ?= 0.1.0
IMAGE_REPO ?= rollout-matching
IMAGE_BASE ?= local
# a CPU image never carries a GPU image's tag: the chart's default tag (IMAGE_TAG) always names a GPU image
IMAGE_TAG_SUFFIX ?= $(if $(filter local,$(IMAGE_BASE)),-cpu,)
LEARNER_IMAGE ?= $(IMAGE_REPO)/learner:$(IMAGE_TAG)$(IMAGE_TAG_SUFFIX)
SERVER_IMAGE ?= $(IMAGE_REPO)/rollout-server:$(IMAGE_TAG)$(IMAGE_TAG_SUFFIX)
LOCAL_BASE_IMAGE ?= $(IMAGE_REPO)/python-base:bookworm
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-2.13.0+cpu-*.whl))

# The images install from the locks: the GPU images (official vLLM 0.26.0 base) from locks/gpu-runtime.txt, the
# CPU images on the local base (Python 3.11, the CPU torch wheel) from locks/cpu-test.txt.
ifeq ($(IMAGE_BASE),local)
IMAGE_EXTRAS ?=
IMAGE_WHEELS := $(TORCH_WHEEL)
IMAGE_BUILD_ARGS = --build-arg BASE_IMAGE=$(LOCAL_BASE_IMAGE) --build-arg EXTRAS=$(IMAGE_EXTRAS) --build-arg LOCK=locks/cpu-test.txt
IMAGE_PREREQS := base-image
else
IMAGE_WHEELS :=
IMAGE_BUILD_ARGS = $(if $(IMAGE_EXTRAS),--build-arg EXTRAS=$(IMAGE_EXTRAS)) --build-arg LOCK=locks/gpu-runtime.txt
IMAGE_PREREQS :=
endif

base-image:
	DOCKER=$(DOCKER) bash images/base/build.sh $(LOCAL_BASE_IMAGE)

images: $(IMAGE_PREREQS)
	@if [ "$(IMAGE_BASE)" = local ] && [ -z "$(TORCH_WHEEL)" ]; then \
	  echo "images on the local base need the CPU torch wheel: make images TORCH_WHEEL=/path/torch-2.13.0+cpu-...whl" >&2; exit 2; fi
	@set -e; index=$$(bash images/context.sh $(IMAGE_WHEELS)); \
	for spec in "learner $(LEARNER_IMAGE)" "rollout-server $(SERVER_IMAGE)"; do \
	  set -- $$spec; start=$$(date +%s); \
	  $(DOCKER) build --network host $(IMAGE_BUILD_ARGS) $${index:+--build-arg PIP_INDEX_URL=$$index} \
	    -f images/$$1/Dockerfile -t $$2 . ; \
	  echo "built $$2 in $$(( $$(date +%s) - start ))s"; \
	done

# What rendering and submitting import: the package without its dependencies, PyYAML, pydantic, Jinja2, Helm's Go
# SDK and the kubernetes client, at the lock's versions (no torch, no test extras). `.core` and `.installed` add the
# rest to the same venv.
DEPLOY_DEPS := pyyaml pydantic jinja2 helm-python-sdk kubernetes
$(VENV)/.deploy: pyproject.toml mk/deploy.mk $(CPU_LOCK) $(LOCK_OVERRIDES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q pip==$(PIP_VERSION)
	$(PIP) install -q uv==$(UV_VERSION)
	$(UV_INSTALL) $(DEPLOY_DEPS)
	$(UV_INSTALL) --no-deps -e .
	touch $@

# job-config comes first so a missing CONFIG fails before any set-up work. CONFIG has no default anywhere
# (grpo.mk's default is scoped to grpo-print): `make job` alone must never submit some other config.
# stdout is render-job's alone: the set-up and its commands go to stderr, so `DRY_RUN=1 make job ... > jobs.yaml`
# writes YAML only.
job: job-config
	@$(MAKE) --no-print-directory $(VENV)/.deploy >&2
	@$(PY) -m trainer render-job --config $(CONFIG)

job-config:
	@test -n "$(strip $(CONFIG))" || { echo "make job: no config given; pass CONFIG=configs/<name>.yaml (DRY_RUN=1 prints the Jobs instead of submitting)" >&2; exit 2; }

presets: $(VENV)/.core
	$(PY) -m trainer.deploy.presets

chart-test: setup
	$(PY) -m pytest -q tests/deploy -m "not docker"
