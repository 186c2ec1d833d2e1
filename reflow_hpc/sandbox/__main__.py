"""Command line of the sandbox.

    python -m reflow_hpc.sandbox --probe                     # the tier this machine gives, and why
    python -m reflow_hpc.sandbox exec [--timeout S] < code.py

``exec`` runs the Python program read from stdin once in the sandbox and prints one JSON line:
``stdout``, ``stderr``, ``exit_code``, ``timed_out``, ``truncated``, ``wall_s``, ``tier`` (and ``error``
when there was no result). The limits are those of ``[sandbox]`` in CONFIG (default: the defaults).
"""

from __future__ import annotations

import argparse
import sys

from ..config import load, main_guard
from .client import Sandbox, require_tier
from .tiers import choose, probe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m reflow_hpc.sandbox",
                                 description="Run untrusted Python in the sandbox.")
    ap.add_argument("command", nargs="?", choices=["exec"], help="exec: run the program on stdin once")
    ap.add_argument("--probe", action="store_true", help="print the tier this machine gives and why, then every tier")
    ap.add_argument("--timeout", type=float, default=None, help="wall-clock limit of the run in seconds "
                                                                "(at most sandbox.wall_time_s)")
    ap.add_argument("--config", default=None, help="TOML config whose [sandbox] section applies")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config key (repeatable)")
    args = ap.parse_args(argv)

    def go() -> int:
        cfg = load(args.config, args.set, check_files=False).sandbox
        if args.probe:
            tier, why = choose(cfg.tier, cfg.allow_weak)
            print(f"tier: {tier or 'none'}: {why}")
            for p in probe():
                print(f"  {p.tier}: {'usable' if p.usable else 'unusable'}: {p.why}")
            return 0 if tier else 1
        if args.command != "exec":
            ap.error("give a command (exec) or --probe")
        code = sys.stdin.read()
        require_tier(cfg)
        with Sandbox(cfg) as sb:
            result = sb.run(code, timeout_s=args.timeout)
        print(result.to_json(), flush=True)
        return 0

    return main_guard(go)


if __name__ == "__main__":
    sys.exit(main())
