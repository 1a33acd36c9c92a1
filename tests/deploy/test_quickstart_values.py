"""The quickstarts' Kubernetes steps, as the pages write them: the ``mine.values.yaml`` each page shows, layered over
the root values file by the page's own ``helm install`` line, renders valid manifests whose learner runs the user's
config (the page's bare-metal config, with its node paths as the pods see them) and mounts the node folders that
hold it; the images the pods run are the ones the page's ``make images`` line builds and its ``docker push`` lines
push; the 6v2 page warms up with stage 1 and starts its servers as the preset does."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest
import yaml
from deploy_helpers import (
    REPO,
    args_of,
    assert_lint_clean,
    assert_valid_kubernetes,
    flag,
    helm,
    manifests_of,
    pod_spec,
    train_yaml,
    workload,
)

from trainer.config.loader import deep_merge
from trainer.config.schema import validate_config
from trainer.deploy import presets
from trainer.deploy.checks import check_manifests

#: page -> (its bare-metal config, the root values file it installs, rollout servers)
PAGES = {
    "docs/quickstart/coco-colocate.md": ("configs/mycoco-colocate.yaml", "values-colocate.yaml", 0),
    "docs/quickstart/coco-servers.md": ("configs/mycoco-6v2.yaml", "values-6v2.yaml", 6),
}


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def saved(text: str, name: str) -> str:
    """The page's yaml block whose first line is ``# <name>``."""
    (block,) = [b for b in fenced(text, "yaml") if b.splitlines()[0].strip() == f"# {name}"]
    return block


def bash_lines(text: str) -> list[str]:
    return [line.split(" #")[0].strip() for b in fenced(text, "bash") for line in b.replace("\\\n", " ").splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def built_tags(make_line: str) -> dict[str, str]:
    """``{image directory: tag}`` of what the page's ``make images …`` line builds (make's own expansion, ``-n``)."""
    words = shlex.split(make_line)
    assert words[:2] == ["make", "images"], make_line
    proc = subprocess.run(["make", "--no-print-directory", "-n", *words[1:]], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return dict(re.findall(r'"(learner|rollout-server) (\S+)"', proc.stdout))


def on_node(path: str, pod: dict) -> str:
    """The node path behind ``path`` in ``pod``'s first container (the longest mount that holds it)."""
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    hits = [m for m in mounts if path.startswith(m.rstrip("/") + "/")]
    assert hits, f"{path} lies on no volume of the pod ({sorted(mounts)})"
    mount = max(hits, key=len)
    (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[mount]]
    assert "hostPath" in volume, volume
    return volume["hostPath"]["path"].rstrip("/") + path[len(mount.rstrip("/")):]


@pytest.mark.parametrize("page", PAGES)
def test_the_quickstart_release_runs_the_users_config_from_the_node_folders(page):
    text = (REPO / page).read_text()
    config_name, root_values, n_servers = PAGES[page]
    mine = yaml.safe_load(saved(text, "mine.values.yaml"))
    lines = bash_lines(text)
    (install,) = [line for line in lines if line.startswith("helm install")]
    words = shlex.split(install)
    files = [words[i + 1] for i, w in enumerate(words) if w == "-f"]
    assert files == [root_values, "mine.values.yaml"], install
    values = deep_merge(helm.values_from_yaml((REPO / root_values).read_text()), mine)
    assert_lint_clean(values)
    with helm.Chart.load(str(REPO / words[3])) as chart:
        docs = manifests_of(chart.render(values, name=words[2], namespace="default", is_install=True))
    assert_valid_kubernetes(docs)
    assert check_manifests(docs, values["node"]["gpuCount"]) == []
    servers, (learner,) = workload(docs, "rollout-server"), workload(docs, "learner")
    assert len(servers) == n_servers

    # the learner runs the mounted config, which is the user's
    args = args_of(learner)
    assert flag(args, "--config") == "/etc/rollout-matching/train.yaml"
    mounted = train_yaml(docs)
    validate_config(mounted, source=page)
    user = mine["learner"]["config"]
    for section in ("model", "data", "stage1"):
        for key, value in user[section].items():
            assert mounted[section][key] == value, (section, key)
    assert mounted["training"]["output_dir"] == user["training"]["output_dir"]
    assert mounted["stage1"]["steps"] > 0, "a freshly prepared checkpoint is warmed up first"

    # ... and it is the page's bare-metal config, its node paths seen through the pod's volumes
    (bare_text,) = [b for b in fenced(text, "yaml") if b.startswith(f"# {config_name}")]
    bare = yaml.safe_load(bare_text)
    pod = pod_spec(learner)
    assert on_node(mounted["model"]["path"], pod) == bare["model"]["path"]
    for key in ("train_jsonl", "eval_jsonl"):
        assert on_node(mounted["data"][key], pod) == bare["data"][key], key
    assert mounted["stage1"] == bare["stage1"] and mounted["training"]["eval_steps"] == bare["training"]["eval_steps"]
    assert on_node(mounted["training"]["output_dir"], pod).startswith(values["storage"]["output"]["hostPath"])
    for server in servers:
        assert on_node(flag(args_of(server), "--model"), pod_spec(server)) == bare["model"]["path"], \
            "the servers decode the checkpoint the learner trains"

    # the images the pods run are built and pushed before the install
    (make,) = [line for line in lines if line.startswith("make images")]
    tags = built_tags(make)
    pushed = [line.split()[2] for line in lines if line.startswith("docker push")]
    assert sorted(pushed) == sorted(tags.values()), (pushed, tags)
    order = [lines.index(x) for x in (make, *(f"docker push {t}" for t in pushed), install)]
    assert order == sorted(order), "build, push, then install"
    for doc, image in [(learner, "learner"), *((s, "rollout-server") for s in servers)]:
        assert pod_spec(doc)["containers"][0]["image"] == tags[image], image


def test_the_data_the_quickstart_imports_is_what_its_configs_read():
    text = (REPO / "docs/quickstart/coco-colocate.md").read_text()
    outs = [flag(shlex.split(line), "--out") for line in bash_lines(text) if "data import" in line]
    for page, (config_name, _, _) in PAGES.items():
        page_text = (REPO / page).read_text()
        (bare_text,) = [b for b in fenced(page_text, "yaml") if b.startswith(f"# {config_name}")]
        data = yaml.safe_load(bare_text)["data"]
        assert [data["train_jsonl"], data["eval_jsonl"]] == outs, page


def test_the_6v2_servers_start_as_the_preset_starts_them():
    text = (REPO / "docs/quickstart/coco-servers.md").read_text()
    (loop,) = [b for b in fenced(text, "bash") if "launch server" in b]
    line = next(x for x in loop.replace("\\\n", " ").splitlines() if "launch server" in x)
    docs_words = shlex.split(line.replace("$((8000 + i))", "8000").replace("$i", "0").rstrip(" &"))
    (preset_line, *_) = presets.bare_metal_commands("6v2-2b-full", yaml.safe_load((REPO / "values-6v2.yaml").read_text()))
    preset_words = shlex.split(preset_line.rstrip(" &"))

    def options(words):
        i = words.index("server") + 1
        return {words[j]: words[j + 1] for j in range(i, len(words) - 1, 2)}

    docs_opts, preset_opts = options(docs_words), options(preset_words)
    docs_opts.pop("--model"), preset_opts.pop("--model")
    assert preset_opts.pop("--tensor-parallel-size") == "1"  # the launcher's default
    assert docs_opts == preset_opts
    assert docs_opts["--cpu-affinity"] == "node"
