"""Policy pack entry point: `pulumi preview --policy-pack infra/policy` (from infra/).

Constructing PolicyPack starts the analyzer server the Pulumi CLI talks to, so this file does
nothing else; the rules live in rules.py where tests can call them directly.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pulumi_policy import PolicyPack
from rules import RESOURCE_POLICIES, STACK_POLICIES

PolicyPack(name="raylift-security", policies=[*RESOURCE_POLICIES, *STACK_POLICIES])
