"""kvscale's images, built with podman (`make image`, tools/images.sh) and run as a cluster runs them.

- engine: runs as a restricted pod would (uid 1000, read-only root FS, tmpfs /tmp, every
  capability dropped, no-new-privileges) and serves /health, a completion (official openai
  client) and /metrics;
- control plane: `kvscale operator --help` and `kvscale router --help` work, there is no torch
  inside, the router's tokenizer loads there and tokenizes exactly as the engine does, and the
  image stays under 400 MB; its router in front of the engine container serves a chat completion;
  its operator, with a real ServiceAccount token, reconciles an InferenceService on the session's
  kube-apiserver;
- layer order: a source change rebuilds only the sources layer (no pip download of torch);
- into a cluster: both images carry the chart's default names (on kvscale's own base, no
  official name shadowed); `make image-archive`'s docker-archive holds both under those names
  and loads into an empty store; `make image-push` puts them in a real registry the user names.

Figures (sizes, build times) come from `python -m bench.image_build`, not from here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from testenv import kwok_toleration

from kvscale.model_files import load_tokenizer, resolve_model_path
from kvscale.processes import free_port, wait_until
from kvscale.tokenization import chat_prompt_token_ids, completion_prompt_token_ids

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGES = REPO_ROOT / "tools" / "images.sh"
# 386 MB measured before the router's endpoint picker brought grpcio and Envoy's API messages
# (xds-protos), about 27 MB installed: the limit still catches torch or a CUDA wheel slipping in.
CONTROL_PLANE_LIMIT_BYTES = 430 * 1000 * 1000
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Hi there"}]


def images_sh(*args: str, timeout: float = 1800, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["bash", str(IMAGES), *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"tools/images.sh {' '.join(args)} failed ({proc.returncode}):\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def podman(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    return images_sh("podman", *args, timeout=timeout, check=check)


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """Both images, built (layers cached from earlier builds) and named."""
    assert shutil.which("podman"), "podman is not installed (make system-deps)"
    names = {which: images_sh("name", which).stdout.strip() for which in ("engine", "control-plane")}
    images_sh("build", "all")
    return names


def test_control_plane_image_runs_the_operator_and_router_without_torch(images):
    image = images["control-plane"]
    for command, expected in (("operator", "--leader-election-namespace"), ("router", "--k8s-namespace-wide")):
        result = podman("run", "--rm", "--read-only", "--user", "1000:1000", "--cap-drop", "ALL",
                        image, command, "--help")
        assert expected in result.stdout, result.stdout
    probe = podman("run", "--rm", "--read-only", "--tmpfs", "/tmp", "--user", "1000:1000",
                   "--entrypoint", "python", image, "-c", _IN_IMAGE_PROBE, timeout=300)
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["torch_installed"] is False and found["heavy_imported"] == []
    # The router's tokenizer in the image gives the ids the engine's own tokenizer gives here.
    engine_tokenizer = load_tokenizer(resolve_model_path(None))
    assert found["completion"] == completion_prompt_token_ids(engine_tokenizer, PROMPT)
    assert found["chat"] == chat_prompt_token_ids(engine_tokenizer, MESSAGES)
    assert found["auto_completion"] == found["completion"]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    assert size < CONTROL_PLANE_LIMIT_BYTES, f"control-plane image is {size / 1e6:.0f} MB"


_IN_IMAGE_PROBE = f"""
import importlib.util, json, sys
from kvscale.router.app import Router
from kvscale.router.config import RouterConfig
from kvscale.tokenization import chat_prompt_token_ids, completion_prompt_token_ids
router = Router(RouterConfig(replicas=["http://127.0.0.1:9"]))
router.hasher.load_tokenizers()
tokenizer = router.hasher.tokenizers["smollm2-135m-instruct"]
print(json.dumps({{
    "torch_installed": importlib.util.find_spec("torch") is not None,
    "heavy_imported": sorted(m for m in ("torch", "triton") if m in sys.modules),
    "completion": completion_prompt_token_ids(tokenizer, {PROMPT!r}),
    "chat": chat_prompt_token_ids(tokenizer, {MESSAGES!r}),
    # What a model other than the bundled one goes through: transformers' auto classes.
    "auto_completion": completion_prompt_token_ids(
        __import__("transformers").AutoTokenizer.from_pretrained(tokenizer.name_or_path), {PROMPT!r}),
}}))
"""


RESTRICTED_POD = ("--init", "--network", "host", "--user", "1000:1000", "--read-only",
                  "--tmpfs", "/tmp:rw,size=256m", "--cap-drop", "ALL",
                  "--security-opt", "no-new-privileges")


def _sample(text: str, series: str) -> float:
    """The value of one series (name plus labels, as exposed) in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in /metrics")


def _start(name: str, image: str, *args: str, options: tuple[str, ...] = ()) -> None:
    podman("run", "-d", "--name", name, *RESTRICTED_POD, *options, image, *args)


def _wait_healthy(name: str, url: str) -> None:
    def healthy() -> bool:
        running = podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip()
        assert running == "true", podman("logs", name, check=False).stderr[-4000:]
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, 300, interval=1.0, what=f"{name}: {url}")


def test_engine_image_serves_as_a_restricted_pod_behind_the_control_plane_router(images):
    """The engine image as a server pod, the control-plane image as its router pod (both with a
    restricted pod's settings): /health, /metrics, and completions straight and through the
    router, whose tokenizer (no torch in its image) hashes the prompt."""
    port, router_port = free_port(), free_port()
    server, router = f"kvscale-test-engine-{port}", f"kvscale-test-router-{router_port}"
    base, router_base = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{router_port}"
    try:
        _start(server, images["engine"], "serve", "--host", "127.0.0.1", "--port", str(port))
        _start(router, images["control-plane"], "router", "--replicas", base, "--host", "127.0.0.1",
               "--port", str(router_port))
        _wait_healthy(server, f"{base}/health")
        assert podman("exec", server, "id", "-u").stdout.strip() == "1000"
        # The server compiled its CPU kernels for this machine at start (the image carries a C
        # compiler) instead of falling back to PyTorch ops.
        logs = podman("logs", server).stderr
        assert "C kernels unavailable" not in logs, logs[-2000:]
        kernels = podman("exec", server, "python", "-c",
                         "from kvscale.kernels import cpu_native; print(cpu_native.available())")
        assert kernels.stdout.strip() == "True", kernels.stderr[-2000:]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert completion.choices[0].text.strip()
        assert completion.usage.completion_tokens > 0
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total"):
            assert name in metrics

        _wait_healthy(router, f"{router_base}/health")  # 200 once it sees a healthy replica
        routed = openai.OpenAI(base_url=f"{router_base}/v1", api_key="unused")
        chat = routed.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content.strip()
        router_metrics = httpx.get(f"{router_base}/metrics", timeout=10).text
        # It tokenized the prompt, with no fallback for want of a tokenizer.
        assert _sample(router_metrics, "kvscale_router_prompt_tokens_total") > 0
        assert _sample(router_metrics, 'kvscale_router_fallbacks_total{reason="no_tokenizer"}') == 0
    finally:
        for name in (router, server):
            podman("rm", "-f", "-t", "5", name, check=False)


def _context_copy(tmp_path: Path) -> Path:
    """What the engine image's build reads from the checkout, copied, to change a file in."""
    context = tmp_path / "context"
    for path in ("pyproject.toml", "README.md", "Dockerfile", ".dockerignore", "kvscale", "server",
                 "kernels", "router", "operator", "tools/images/requirements.py"):
        source, target = REPO_ROOT / path, context / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    return context


def test_a_source_change_rebuilds_only_the_source_layer(images, tmp_path):
    """The build context with one source file changed, and pyproject.toml outside the engine's
    group (a new dev pin): every dependency layer comes from the cache (no torch download), only
    the sources are installed again."""
    context = _context_copy(tmp_path)
    with open(context / "router" / "cli_router.py", "a") as changed:
        changed.write("\n# a source change\n")
    pyproject = context / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('dev = ["', 'dev = ["six==1.17.0", "', 1))
    registry = f"localhost/kvscale-layer-test-{time.monotonic_ns()}"
    build = subprocess.run(["bash", str(IMAGES), "build", "engine"], capture_output=True, text=True,
                           timeout=900, env={**os.environ, "KVSCALE_BUILD_CONTEXT": str(context),
                                             "KVSCALE_IMAGE_REGISTRY": registry})
    try:
        assert build.returncode == 0, build.stderr[-6000:]
        log = build.stdout + build.stderr
        # A multi-stage build prefixes each step with its stage ("[2/2] STEP 6/21: ...").
        steps = [line for line in log.splitlines() if line.split("] ", 1)[-1].startswith("STEP ")]
        # Both dependency layers: torch and triton's, and the rest's (Dockerfile, step 1).
        for requirements in ("heavy.txt", "light.txt"):
            pip_step = next(line for line in steps if f"install -r /tmp/build/{requirements}" in line)
            after_pip = log.split(pip_step, 1)[1].split("STEP ", 1)[0]
            assert "Using cache" in after_pip, after_pip
        assert "Downloading torch" not in log
        sources_step = next(line for line in steps if "install --no-deps /tmp/src" in line)
        assert "Using cache" not in log.split(sources_step, 1)[1].split("STEP ", 1)[0]
    finally:
        podman("rmi", "-f", f"{registry}/kvscale:0.1.0", check=False)


@pytest.mark.k8s
def test_control_plane_image_runs_the_operator_against_a_real_apiserver(images, k8s_env, tmp_path):
    """`kvscale operator` from the control-plane image (restricted pod settings), with a real
    token of the ServiceAccount deploy/rbac.yaml makes, reconciles an InferenceService."""
    env = k8s_env
    namespace = "image-operator"
    env.kubectl("apply", "-f", str(REPO_ROOT / "crds"), "-f", str(REPO_ROOT / "deploy" / "rbac.yaml"))
    if env.kubectl("get", "namespace", namespace, check=False).returncode != 0:
        env.kubectl("create", "namespace", namespace)
    kubeconfig = env.kubeconfig_with_token("kvscale-system", "kvscale-operator")
    mounted = tmp_path / "kubeconfig"
    mounted.write_bytes(kubeconfig.read_bytes())
    mounted.chmod(0o644)  # readable by uid 1000 in the container
    name = f"kvscale-test-operator-{free_port()}"
    _start(name, images["control-plane"], "operator", f"--namespace={namespace}", "--no-leader-elect",
           "--kubeconfig=/etc/kvscale/kubeconfig", "--metrics-host=127.0.0.1",
           f"--metrics-port={free_port()}", options=("-v", f"{mounted}:/etc/kvscale/kubeconfig:ro"))
    service = {
        "apiVersion": "serving.kvscale.io/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "chat", "namespace": namespace},
        "spec": {"model": {"uri": "bundled://smollm2-135m-instruct"},
                 "resources": {"gpus": 1, "cpu": "1", "memory": "2Gi"},
                 "tolerations": [kwok_toleration()]},
    }
    try:
        env.kubectl("apply", "-f", "-", input=json.dumps(service))

        def reconciled() -> bool:
            assert podman("inspect", "--format", "{{.State.Running}}", name).stdout.strip() == "true", \
                podman("logs", name, check=False).stderr[-4000:]
            status = env.kubectl_json("get", "inferenceservice", "chat", "-n", namespace).get("status") or {}
            return bool(status.get("url")) and any(c["type"] == "Ready" for c in status.get("conditions") or [])

        wait_until(reconciled, 120, interval=1.0, what="the operator container reconciling chat")
        assert env.kubectl("get", "deployment", "chat", "-n", namespace, check=False).returncode == 0
        env.kubectl("delete", "inferenceservice", "chat", "-n", namespace, "--wait=false")
        wait_until(lambda: env.kubectl("get", "inferenceservice", "chat", "-n", namespace,
                                       check=False).returncode != 0,
                   60, interval=0.5, what="chat deleted (the operator drops its finalizer)")
        logs = podman("logs", name).stdout + podman("logs", name).stderr
        assert "forbidden" not in logs.lower()
    finally:
        podman("rm", "-f", "-t", "10", name, check=False)
        env.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


# --------------------------------------------------------------------------- into a cluster

def chart_default_images() -> set[str]:
    """The images the chart runs when no `images.*` value is set: repository and appVersion."""
    chart = REPO_ROOT / "charts" / "kvscale"
    version = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    values = yaml.safe_load((chart / "values.yaml").read_text())["images"]
    assert not values["engine"]["tag"] and not values["controlPlane"]["tag"]  # appVersion, below
    return {f"{values[which]['repository']}:{version}" for which in ("engine", "controlPlane")}


def test_the_images_are_built_under_the_charts_default_names(images):
    assert set(images.values()) == chart_default_images()
    # Built on kvscale's own base, never under an official image's name.
    base = images_sh("podman", "image", "inspect", "--format", "{{.Id}}",
                     "localhost/kvscale/python-base:3.11-bookworm").stdout.strip()
    assert base
    assert podman("image", "exists", "docker.io/library/python:3.11-slim", check=False).returncode != 0


def test_the_archive_holds_both_images_under_the_charts_names(images):
    """`tools/images.sh archive -` (make image-archive's docker-archive, streamed to the reader;
    podman stages it in the invocation's temporary folder first) holds both images, named as the
    chart names them, with every layer they list."""
    proc = subprocess.Popen(["bash", str(IMAGES), "archive", "-"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None
    members, manifest = set(), None
    with tarfile.open(fileobj=proc.stdout, mode="r|") as archive:
        for member in archive:
            members.add(member.name)
            if member.name == "manifest.json":
                manifest = json.load(archive.extractfile(member))  # type: ignore[arg-type]
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr.decode()[-4000:]
    assert manifest is not None, sorted(members)[:20]
    assert {tag for entry in manifest for tag in entry["RepoTags"]} == chart_default_images()
    for entry in manifest:
        assert {entry["Config"], *entry["Layers"]} <= members, entry["RepoTags"]
    # An image missing from the store is an error, not a smaller archive.
    missing = subprocess.run(["bash", str(IMAGES), "archive", "-", "engine"], capture_output=True,
                             text=True, env={**os.environ, "KVSCALE_IMAGE_REGISTRY": "nowhere.example"},
                             timeout=120)
    assert missing.returncode != 0 and "make image" in missing.stderr


def test_an_archive_loads_into_a_fresh_store_and_runs(images, tmp_path):
    """What `ctr import` / `kind load image-archive` do with the file, done by a podman with an
    empty store of its own: the control-plane image (the small one) comes back under its name
    and runs."""
    path = tmp_path / "control-plane.tar"
    saved = images_sh("archive", str(path), "control-plane")
    assert saved.stdout.strip().splitlines()[-1] == str(path) and path.stat().st_size > 0
    fresh = {**os.environ, "KVSCALE_PODMAN_DIR": str(tmp_path / "fresh-store")}
    try:
        def in_fresh(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["bash", str(IMAGES), "podman", *args], capture_output=True,
                                  text=True, env=fresh, timeout=600)

        assert in_fresh("image", "exists", images["control-plane"]).returncode != 0
        loaded = in_fresh("load", "-i", str(path))
        assert loaded.returncode == 0, loaded.stderr
        assert images["control-plane"] in loaded.stdout
        ran = in_fresh("run", "--rm", "--read-only", "--user", "1000:1000", images["control-plane"],
                       "router", "--help")
        assert ran.returncode == 0 and "--k8s-namespace-wide" in ran.stdout, ran.stderr
    finally:
        # Only the fresh store's images (its folder goes with tmp_path); never a reset, which
        # could reach further than this store.
        subprocess.run(["bash", str(IMAGES), "podman", "rmi", "--all", "--force"], env=fresh,
                       capture_output=True, timeout=300, check=False)


def podman_tmp() -> Path:
    """Where tools/images.sh points podman's TMPDIR: one `pid-N` folder per invocation."""
    state = os.environ.get("KVSCALE_PODMAN_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvscale", "podman")
    return Path(state) / "tmp"


def test_a_failed_import_leaves_no_archive_behind(images):
    """`podman save` to a pipe writes the whole archive to a temporary file first and leaves it
    there when the reader fails: a containerd import that failed once left the engine's ~6 GB
    behind, and the next run of the node lane found the disk full. The control-plane image,
    streamed by tools/node-images.sh into a containerd socket that does not exist, fails; its
    archive goes with the invocation."""
    before = set(podman_tmp().iterdir())
    failed = subprocess.run(["bash", str(REPO_ROOT / "tools" / "node-images.sh"), "import",
                             "/nonexistent/containerd.sock", images["control-plane"]],
                            capture_output=True, text=True, timeout=600)
    assert failed.returncode != 0 and "importing" in failed.stderr, failed.stderr[-2000:]
    assert set(podman_tmp().iterdir()) - before == set()


def test_a_killed_invocations_temporary_folder_goes_with_the_next_one(images):
    """A tools/images.sh killed by a signal runs no EXIT trap: the next invocation removes the
    folder of a process that is gone, and never one of a process still running."""
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = podman_tmp() / f"pid-{finished.pid}"
    live = podman_tmp() / f"pid-{os.getpid()}"
    for folder in (dead, live):
        folder.mkdir()
        (folder / "archive").write_bytes(b"x" * 4096)
    try:
        podman("image", "exists", images["control-plane"])
        assert not dead.exists()
        assert (live / "archive").exists()
    finally:
        shutil.rmtree(dead, ignore_errors=True)
        shutil.rmtree(live, ignore_errors=True)


def test_push_sends_the_images_to_the_registry_the_user_names(images, tmp_path):
    """`make image-push REGISTRY=host/path` (tools/images.sh push) against a real registry
    (Debian's docker-registry, plain HTTP on loopback): the image arrives as
    REGISTRY/<its repository name>:<tag>, the names `--set images.*.repository=REGISTRY/...`
    gives the chart, and its manifest's config is the local image's."""
    binary = shutil.which("docker-registry")
    assert binary, "docker-registry is not installed (make system-deps)"
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(yaml.safe_dump({
        "version": 0.1, "log": {"level": "warn"},
        "storage": {"filesystem": {"rootdirectory": str(tmp_path / "blobs")}},
        "http": {"addr": f"127.0.0.1:{port}"}}))
    registry = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _registry_up(port), 30, what="docker-registry /v2/")
        target = f"127.0.0.1:{port}/team/ml"
        pushed = subprocess.run(["bash", str(IMAGES), "push", target, "control-plane"],
                                capture_output=True, text=True, timeout=900,
                                env={**os.environ, "KVSCALE_PUSH_TLS_VERIFY": "false"})
        assert pushed.returncode == 0, pushed.stderr[-4000:]
        name = images["control-plane"].rsplit("/", 1)[-1]  # kvscale-control-plane:<version>
        repository, tag = name.split(":")
        assert pushed.stdout.split() == [f"{target}/{name}"]
        base = f"http://127.0.0.1:{port}/v2/team/ml/{repository}"
        assert httpx.get(f"{base}/tags/list", timeout=10).json()["tags"] == [tag]
        manifest = httpx.get(f"{base}/manifests/{tag}", timeout=10, headers={"Accept": ", ".join((
            "application/vnd.oci.image.manifest.v1+json",
            "application/vnd.docker.distribution.manifest.v2+json"))}).json()
        local_id = podman("image", "inspect", "--format", "{{.Id}}", images["control-plane"]).stdout.strip()
        assert manifest["config"]["digest"] == f"sha256:{local_id}"
        # Nothing but a registry to push to is an error.
        assert subprocess.run(["bash", str(IMAGES), "push"], capture_output=True,
                              timeout=60).returncode != 0
    finally:
        podman("rmi", f"127.0.0.1:{port}/team/ml/{images['control-plane'].rsplit('/', 1)[-1]}",
               check=False)
        registry.terminate()
        registry.wait(timeout=30)


def _registry_up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
