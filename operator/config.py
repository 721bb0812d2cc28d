"""What `kvscale operator`'s flags set for the handlers."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from kvscale.operator.allow_list import AllowList
from kvscale.operator.bounded_get import DEFAULT_MAX_BYTES
from kvscale.operator.children.owned import Images
from kvscale.operator.children.servers import server_default_flags, with_server_defaults
from kvscale.operator.conditions import Condition
from kvscale.operator.lora_adapters import refusal as lora_refusal
from kvscale.operator.spec import InferenceServiceSpec
from kvscale.operator.tensor_parallel import refusal as tensor_parallel_refusal

# The server-side-apply field manager: the fields the operator owns in every child.
FIELD_MANAGER = "kvscale-operator"


@dataclass(frozen=True)
class OperatorConfig:
    resync_interval: float = 10.0
    scrape_interval: float = 5.0
    scrape_timeout: float = 2.0
    scrape_max_bytes: int = DEFAULT_MAX_BYTES
    allow_metrics_url_override: bool = False
    cluster_domain: str = "cluster.local"
    images: Images = field(default_factory=Images)
    allow: AllowList = field(default_factory=AllowList)
    # `kvscale serve` flags every server gets unless its engine.extraArgs sets the same flag, one
    # group per flag (servers.server_default_flags), checked and grouped once, at start.
    server_defaults: tuple[tuple[str, ...], ...] = ()

    def refusal(self, spec: InferenceServiceSpec) -> Condition | None:
        """Synced=False with why, for a spec that gets nothing applied: a choice outside the
        allow-lists, or tensor parallel or LoRA settings its servers could not start with or
        would not honour (judged with the platform's defaults, as the servers run); None: apply
        it."""
        served = with_server_defaults(spec, self.server_defaults)
        return self.allow.refusal(spec) or tensor_parallel_refusal(served) or lora_refusal(served)


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    """The configuration `kvscale operator`'s parsed flags (cli_operator.add_arguments) give;
    SystemExit for server defaults that are no `kvscale serve` flags or set the operator's own:
    the operator then stops before serving anything, rather than building servers that fail."""
    # argparse reads `--server-default-arg=--` as an empty list: put the "--" back, to refuse.
    given = tuple(a if isinstance(a, str) else "--" for a in args.server_default_arg)
    try:
        server_defaults = server_default_flags(given)
    except ValueError as exc:
        raise SystemExit(f"--server-default-arg (the chart's operator.serverDefaultArgs): {exc}") from None
    return OperatorConfig(
        resync_interval=args.resync_interval,
        scrape_interval=args.scrape_interval,
        scrape_timeout=args.scrape_timeout,
        scrape_max_bytes=args.scrape_max_bytes,
        allow_metrics_url_override=args.allow_metrics_url_override,
        cluster_domain=args.cluster_domain,
        images=Images(router=args.router_image, redis=args.redis_image, engine=args.engine_image),
        allow=AllowList(tuple(args.allowed_image), tuple(args.allowed_api_key_secret)).with_own_images(
            args.engine_image, args.router_image, args.redis_image),
        server_defaults=server_defaults,
    )
