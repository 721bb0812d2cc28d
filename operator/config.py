"""What `kvscale operator`'s flags set for the handlers."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscale.operator.children.owned import Images

# The server-side-apply field manager: the fields the operator owns in every child.
FIELD_MANAGER = "kvscale-operator"


@dataclass(frozen=True)
class OperatorConfig:
    resync_interval: float = 10.0
    scrape_interval: float = 5.0
    scrape_timeout: float = 2.0
    allow_metrics_url_override: bool = False
    cluster_domain: str = "cluster.local"
    images: Images = field(default_factory=Images)
