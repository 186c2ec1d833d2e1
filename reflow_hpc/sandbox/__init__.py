"""A sandbox for untrusted model-written Python: tiers (``tiers``), the fork server that runs inside
(``server``), the trainer's pool of servers (``client``), judging outside (``judge``), and the bounded
helper process they are built on (``helper``). Threat model: docs/sandbox.md."""

from .client import RunResult, Sandbox, SandboxUnavailable, require_tier, shared_sandbox
from .judge import FunctionRun, call_function, outputs_match, reward
from .tiers import choose, probe

__all__ = ["RunResult", "Sandbox", "SandboxUnavailable", "require_tier", "shared_sandbox", "FunctionRun", "call_function",
           "outputs_match", "reward", "choose", "probe"]
