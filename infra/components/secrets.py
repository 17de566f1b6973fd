"""The Ray auth token: generated once, kept in Secrets Manager, read by nodes at boot.

How Ray token auth is switched on (checked against Ray 2.60 and its docs):
- docs.ray.io/en/latest/ray-security/token-auth.html: "set the environment variable
  RAY_AUTH_MODE=token before starting your Ray cluster"; available from Ray 2.52.
- docs.ray.io/en/master/ray-core/internals/token-authentication.html: the token is read from
  RAY_AUTH_TOKEN, else from the file named by RAY_AUTH_TOKEN_PATH (an unreadable or empty file is
  fatal, not a silent fallback), else ~/.ray/auth_token; RAY_AUTH_MODE must be set on every node.
- ray 2.60.0 wheel: authentication_token_setup.py defines AUTH_MODE_ENV_VAR = "RAY_AUTH_MODE";
  `ray start --head` (scripts.py) calls maybe_enable_token_auth_if_token_available(), i.e. with
  RAY_AUTH_MODE unset it turns auth on only if a token happens to exist, else warns and runs open.
The bootstrap (components/userdata.sh.tmpl) therefore sets RAY_AUTH_MODE=token explicitly, with
RAY_AUTH_TOKEN_PATH pointing at a read-only mounted file, on every node: a missing token is then
a hard start failure instead of a silently unauthenticated cluster.

The token never appears in user data, images or stack outputs: nodes fetch it from Secrets
Manager with their role. pulumi-random keeps the value stable in state, so `pulumi up` does not
rotate it under a live cluster (aws.secretsmanager.get_random_password would return a new value
on every run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws
import pulumi_random as random


@dataclass(frozen=True)
class RayTokenArgs:
    cluster_name: str
    tags: dict[str, str] = field(default_factory=dict)


class RayToken(pulumi.ComponentResource):
    """A 64-character random token stored as a Secrets Manager secret."""

    secret_arn: pulumi.Output[str]
    # The secret's value: a node that boots before it exists fetches nothing.
    boot_dependencies: list[pulumi.Resource]

    def __init__(
        self, name: str, args: RayTokenArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("raylift:infra:RayToken", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        # Alphanumeric only: it travels in an HTTP Authorization header and a file, unquoted.
        token = random.RandomPassword(f"{name}-value", length=64, special=False, opts=child)
        secret = aws.secretsmanager.Secret(
            f"{name}-secret",
            name_prefix=f"{args.cluster_name}/ray-auth-token-",
            description=f"Ray token auth secret for Raylift cluster {args.cluster_name}",
            recovery_window_in_days=7,
            tags=args.tags,
            opts=child,
        )
        version = aws.secretsmanager.SecretVersion(
            f"{name}-version",
            secret_id=secret.id,
            secret_string=token.result,
            opts=child,
        )
        self.secret_arn = secret.arn
        self.boot_dependencies = [version]
        self.register_outputs({"secretArn": secret.arn})
