"""Import what `kvscale operator` and `kvscale router` run, so that exactly those modules get
their bytecode written into the control-plane image.

That image installs its dependencies with `pip --no-compile`: bytecode for every module of
transformers and the kubernetes client would be ~180 MB, most of it for code the control plane
never imports. Without any, each start on the read-only root filesystem would compile its imports
again. A module left out here still works; it is only compiled at each start.
"""

import kopf  # noqa: F401
import kubernetes.client  # noqa: F401
import kubernetes.config  # noqa: F401
import kubernetes.watch  # noqa: F401
import uvicorn  # noqa: F401
import uvicorn.loops.uvloop  # noqa: F401
import uvicorn.protocols.http.httptools_impl  # noqa: F401

import kvscale.cli  # noqa: F401
import kvscale.operator.cli_operator  # noqa: F401
import kvscale.operator.kube  # noqa: F401
import kvscale.operator.registration  # noqa: F401
import kvscale.router.cli_router  # noqa: F401
import kvscale.router.replicas  # noqa: F401
from kvscale.router.app import Router
from kvscale.router.config import RouterConfig

Router(RouterConfig(replicas=["http://127.0.0.1:9"])).hasher.load_tokenizers()
