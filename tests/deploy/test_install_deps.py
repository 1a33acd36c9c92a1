"""images/install-deps.py: pins apply only to what the base image lacks; torch never comes from an index."""

from __future__ import annotations

import importlib.util

from deploy_helpers import REPO

spec = importlib.util.spec_from_file_location("install_deps", REPO / "images" / "install-deps.py")
install_deps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(install_deps)


def test_pins_skip_packages_the_base_ships_and_torch_is_never_requested():
    requirements = ["torch>=2.4", "transformers>=5.0", "binpacking>=1.5", "PyYAML>=6.0"]
    constraints = ["# comment", "transformers==5.23.0", "binpacking==2.0.1", "pyyaml==6.0.3", "", "dumb-init==1.2.5.post1"]
    reqs, pins = install_deps.plan(requirements, constraints, installed={"torch", "transformers", "vllm"})
    assert reqs == ["transformers>=5.0", "binpacking>=1.5", "PyYAML>=6.0"]
    assert pins == ["binpacking==2.0.1", "pyyaml==6.0.3", "dumb-init==1.2.5.post1"]


def test_names_are_compared_canonically():
    assert install_deps.requirement_name("Typing_Extensions>=4 ; python_version>'3'") == "typing-extensions"
    assert install_deps.requirement_name("# only a comment") is None


def test_every_core_dependency_is_pinned_for_image_builds():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pinned = {install_deps.requirement_name(line) for line in (REPO / "images" / "constraints.txt").read_text().splitlines()
              if "==" in line}
    wanted = {install_deps.requirement_name(r) for r in project["dependencies"]} - {"torch"}
    for extra in ("deepspeed", "swift", "kubernetes"):
        wanted |= {install_deps.requirement_name(r) for r in project["optional-dependencies"][extra]}
    assert wanted - pinned == set(), "add these to images/constraints.txt"
