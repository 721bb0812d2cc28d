"""What an InferenceService may choose: its server image and its API-key Secret, from lists the
operator is started with (the chart's `operator.allowedImages` and
`operator.allowedApiKeySecrets`, docs/operator.md "What an InferenceService may choose").

Whoever may create an InferenceService would otherwise pick any image to run, with the
operator's pod settings, and any Secret of its namespace to feed it. An image is allowed when it
is one of the listed repositories at any tag or digest (`REPO`, `REPO:TAG`, `REPO@sha256:...`),
never by a bare prefix (`ghcr.io/kvscale/kvscale` does not allow `ghcr.io/kvscale/kvscale-evil`);
the operator's own images are always allowed. A Secret name is matched as a shell pattern
(`fnmatch`: `*-api-key`). An empty list allows anything. The decision is a pure function; the
chart's admission policy holds the operator's account to the same lists.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from kvscale.operator.conditions import SYNCED, Condition
from kvscale.operator.spec import InferenceServiceSpec

IMAGE_NOT_ALLOWED = "ImageNotAllowed"
SECRET_NOT_ALLOWED = "SecretNotAllowed"


def image_in(image: str, repositories: tuple[str, ...]) -> bool:
    """Whether ``image`` is one of ``repositories`` at some tag or digest."""
    return any(image == repo or image.startswith((repo + ":", repo + "@")) for repo in repositories)


def repository_of(image: str) -> str:
    """``registry:5000/a/b:tag`` -> ``registry:5000/a/b`` (a port is not a tag)."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


@dataclass(frozen=True)
class AllowList:
    images: tuple[str, ...] = ()  # repositories; empty: any image
    api_key_secrets: tuple[str, ...] = ()  # name patterns; empty: any Secret

    def with_own_images(self, *images: str) -> AllowList:
        """The operator's own images (engine, router, Redis) added when a list is in force."""
        if not self.images:
            return self
        own = tuple(repository_of(i) for i in images if repository_of(i) not in self.images)
        return AllowList(self.images + own, self.api_key_secrets)

    def refusal(self, spec: InferenceServiceSpec) -> Condition | None:
        """Synced=False with why, for a spec choosing what the lists do not allow; None: allowed."""
        if self.images and spec.image and not image_in(spec.image, self.images):
            return Condition(SYNCED, False, IMAGE_NOT_ALLOWED,
                             f"spec.image {spec.image} is not in the operator's allowed images "
                             f"({', '.join(self.images)}): nothing is applied")
        secret = spec.api_key_secret
        if self.api_key_secrets and secret is not None and not any(
                fnmatchcase(secret.name, pattern) for pattern in self.api_key_secrets):
            return Condition(SYNCED, False, SECRET_NOT_ALLOWED,
                             f"spec.apiKeySecretRef {secret.name} matches none of the operator's "
                             f"allowed API-key Secrets ({', '.join(self.api_key_secrets)}): "
                             "nothing is applied")
        return None
