"""Image sizes and build times (docs/deploy.md quotes them).

    python -m bench.image_build            # with the cache `make image` keeps (warm)
    python -m bench.image_build --cold     # from nothing: a fresh podman store, base image included

Measures: each step of `tools/images.sh build all` (base image, engine, control plane), a rebuild
of the engine after one source file changes (the layer order's point: no dependency layer runs
again), both images' sizes, and the engine container's time from `podman run` to /health 200 when
run as a restricted pod. The baseline of the rebuild is the full build of the same run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import REPO, exit_on_sigterm, machine, write_result
from kvscale.processes import free_port, wait_until

IMAGES = REPO / "tools" / "images.sh"
CONTEXT = ("pyproject.toml", "README.md", "Dockerfile", "Dockerfile.control-plane", ".dockerignore",
           "kvscale", "server", "kernels", "router", "operator", "tools/images")


def images_sh(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["bash", str(IMAGES), *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"tools/images.sh {' '.join(args)} failed:\n{proc.stderr[-4000:]}")
    return proc


def step_seconds(log: str) -> dict[str, int]:
    """`images: built NAME in Ns` / `made NAME in Ns` lines of tools/images.sh."""
    return {m.group(2): int(m.group(3)) for m in re.finditer(r"images: (built|made) (\S+) in (\d+)s", log)}


def changed_context(tmp: Path) -> Path:
    context = tmp / "context"
    for path in CONTEXT:
        source, target = REPO / path, context / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    with open(context / "router" / "cli_router.py", "a") as changed:
        changed.write("\n# a source change\n")
    return context


def seconds_to_healthy(image: str, env: dict[str, str]) -> float:
    port = free_port()
    name = f"kvscale-bench-{port}"
    started = time.monotonic()
    images_sh("podman", "run", "-d", "--name", name, "--init", "--network", "host", "--user", "1000:1000",
              "--read-only", "--tmpfs", "/tmp:rw,size=256m", "--cap-drop", "ALL", "--security-opt",
              "no-new-privileges", image, "serve", "--host", "127.0.0.1", "--port", str(port), env=env)
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 300, interval=0.25, what="engine /health")
        return time.monotonic() - started
    finally:
        subprocess.run(["bash", str(IMAGES), "podman", "rm", "-f", "-t", "5", name], capture_output=True,
                       env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cold", action="store_true", help="build in a fresh podman store")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    exit_on_sigterm()  # the engine container `podman run -d` started is removed on SIGTERM too

    result: dict[str, Any] = {"machine": machine(), "cold": args.cold,
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="kvscale-image-bench-") as tmp_name:
        tmp = Path(tmp_name)
        env = dict(os.environ)
        if args.cold:
            env["KVSCALE_PODMAN_DIR"] = str(tmp / "podman")
        started = time.monotonic()
        build = images_sh("build", "all", env=env)
        result["build_all_s"] = round(time.monotonic() - started, 1)
        result["steps_s"] = step_seconds(build.stderr)
        names = {which: images_sh("name", which, env=env).stdout.strip() for which in ("engine", "control-plane")}
        result["size_bytes"] = {
            which: int(images_sh("podman", "image", "inspect", "--format", "{{.Size}}", name, env=env).stdout)
            for which, name in names.items()}

        started = time.monotonic()
        registry = "localhost/kvscale-bench"
        rebuild = images_sh("build", "engine", env={**env, "KVSCALE_BUILD_CONTEXT": str(changed_context(tmp)),
                                                     "KVSCALE_IMAGE_REGISTRY": registry})
        result["engine_rebuild_after_source_change_s"] = round(time.monotonic() - started, 1)
        result["rebuild_downloaded_torch"] = "Downloading torch" in rebuild.stdout + rebuild.stderr
        images_sh("podman", "rmi", "-f", f"{registry}/kvscale:0.1.0", env=env)

        result["engine_seconds_to_healthy"] = round(seconds_to_healthy(names["engine"], env), 1)
        if args.cold:
            # The store belongs to root-owned overlay mounts; podman removes it properly.
            subprocess.run(["bash", str(IMAGES), "podman", "system", "reset", "-f"], env=env,
                           capture_output=True)
    path = write_result("image_build_cold" if args.cold else "image_build", result, args.out)
    print(path)
    print(result)


if __name__ == "__main__":
    main()
