"""The Coordinator's image (Dockerfile): what it copies is all that `python app.py` needs, what it installs
covers what that code imports, and it agrees with the manifests the deployer renders.

No image is built here (CI has no Docker daemon): the tree the Dockerfile's COPY lines make is rebuilt in
a temporary directory, and the Coordinator started from it serves through the OpenAI SDK.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import openai
import yaml

import config
from deployer import render as R
from deployer.settings import COORDINATOR_CODE_DIR, load
from harness.configs import coordinator_config
from harness.coordinator import Coordinator

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
IGNORED = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]


def instructions(name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in DOCKERFILE.splitlines() if line.split(None, 1)[:1] == [name]]


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY line."""
    out = []
    for args in instructions("COPY"):
        *sources, dest = args.split()
        out.append((sources, dest))
    return out


def ignored(rel: str) -> bool:
    """Docker's .dockerignore match, for the patterns this project uses: a path, a glob, `**/` any depth."""
    parts = rel.split("/")
    for pattern in IGNORED:
        if pattern.startswith("**/"):
            tail = pattern[3:]
            if any(fnmatch.fnmatch(part, tail) for part in parts):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            return True
    return False


def copied_files() -> list[tuple[Path, str]]:
    """Every file the COPY lines put in the image: (source, path under WORKDIR)."""
    out = []
    for sources, dest in copies():
        for src in sources:
            path = ROOT / src
            assert path.exists(), f"COPY {src}: no such file in the repository"
            if path.is_dir():
                for f in sorted(path.rglob("*")):
                    rel = f.relative_to(ROOT).as_posix()
                    if f.is_file() and not ignored(rel):
                        out.append((f, os.path.join(dest, f.relative_to(path).as_posix())))
            else:
                assert not ignored(src), f"COPY {src}: excluded by .dockerignore"
                target = os.path.join(dest, path.name) if dest.endswith("/") else dest
                out.append((path, target))
    return out


def test_every_copied_source_exists_and_no_tracked_file_is_ignored():
    files = copied_files()
    assert any(target == "./app.py" for _, target in files)
    for sources, _ in copies():
        for src in sources:
            if (ROOT / src).is_dir():
                python = [f for f in (ROOT / src).rglob("*.py") if "__pycache__" not in f.parts]
                assert python and all(any(f == s for s, _ in files) for f in python), f"{src}: files left out"


def test_the_image_tree_alone_starts_and_serves(tmp_path):
    image = tmp_path / "image"
    for src, target in copied_files():
        dest = image / target
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)
    assert not (image / "tests").exists() and not (image / "bench").exists()
    # No instances: the built-in engine simulator (engine_sim, copied into the image) serves.
    cfg = coordinator_config([])
    with Coordinator(cfg, root=str(image)) as coord:
        client = openai.OpenAI(base_url=coord.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert answer.choices[0].message.content and answer.usage.completion_tokens == 4
        assert "built-in engine simulator" in coord.output()


def test_what_the_image_installs_covers_what_its_code_imports():
    installed = set()
    for args in instructions("RUN"):
        if args.startswith("pip install"):
            for word in args.split()[2:]:
                if word == "-r":
                    continue
                if word.endswith(".txt"):
                    lines = (ROOT / word).read_text().splitlines()
                    installed |= {
                        re.split(r"[=<>\[ ]", ln, maxsplit=1)[0] for ln in lines if ln and not ln.startswith("#")
                    }
                elif not word.startswith("-"):
                    installed.add(re.split(r"[=<>\[]", word, maxsplit=1)[0])
    installed = {name.lower().replace("_", "-") for name in installed}
    local = {Path(target).parts[0].removesuffix(".py") for _, target in copied_files() if target != "./"}
    local |= {Path(target).name.removesuffix(".py") for _, target in copied_files()}
    modules = set()
    for src, target in copied_files():
        if target.endswith(".py"):
            for node in ast.walk(ast.parse(src.read_text())):
                if isinstance(node, ast.Import):
                    modules |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules.add(node.module.split(".")[0])
    third_party = {m for m in modules if m not in sys.stdlib_module_names and m not in local}
    dists = packages_distributions()
    assert third_party, "no third-party import found: the scan is broken"
    for module in sorted(third_party):
        names = {d.lower().replace("_", "-") for d in dists.get(module, [module])}
        assert names & installed, f"{module} (from {names}) is imported by the image's code but not installed by it"


def test_the_tokenizers_pin_is_the_tests_pin():
    tests_pin = re.search(r"^tokenizers==(\S+)$", (ROOT / "requirements-test.txt").read_text(), re.M).group(1)
    assert f"tokenizers=={tests_pin}" in DOCKERFILE


def test_the_image_agrees_with_the_rendered_manifests():
    settings = load(json.loads((ROOT / "deployer" / "user_config.json").read_text()))
    files = R.render(settings)
    docs = [d for name, text in files.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment" and "coordinator" in d["metadata"]["name"])
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # The manifest runs `python app.py --config ...` in the image's working directory, as the USER the image sets.
    assert container["command"][:2] == ["python", "app.py"]
    assert instructions("CMD") == ['["python", "app.py"]']
    uid = int(instructions("USER")[-1].split(":")[0])
    assert pod["securityContext"]["runAsUser"] == uid == settings.deploy.run_as_user
    assert container["image"] == settings.deploy.image_name
    # The deployer keeps tls_mount_path off the code directory: it must be the image's.
    assert instructions("WORKDIR") == [COORDINATOR_CODE_DIR]
    # EXPOSE names the Coordinator's default ports (interface.md section 1).
    defaults = config.Settings()
    assert [int(p) for p in instructions("EXPOSE")[0].split()] == [
        defaults.infer_port,
        defaults.mgmt_port,
        defaults.obs_port,
    ]
