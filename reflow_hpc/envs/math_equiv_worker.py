"""The equivalence process behind :func:`reflow_hpc.envs.math_reward` (run as a script, never imported).

It is started as a fresh interpreter (``python -P <this file> <memory bytes>``) and speaks JSON lines:
it writes one ``{"ready": …}`` line once math-verify is loaded (or ``{"error": …}`` and exits), then
answers each ``[answer, reference]`` line with ``{"ok": true|false}``. It imports only the standard
library and math-verify, so it carries none of its parent's state (MPI, CUDA, threads).

math-verify's own timeouts use ``signal.alarm``; they are disabled here, and the parent bounds each
call from outside (it kills this process past its deadline). The address space is capped with
``RLIMIT_AS`` after the imports; a call that runs out of memory answers false and the process exits,
so the next call gets a fresh one.
"""

import json
import logging
import os
import resource
import sys


def _reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as e:
        _reply({"error": f"math-verify is not installed ({e}); install the math extra: pip install -e '.[math]'"})
        return 1
    logging.disable(logging.WARNING)   # "timeout disabled" warnings: the parent bounds every call
    targets = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    def equal(answer, reference):
        gold = parse("$" + reference + "$", targets, parsing_timeout=None)
        pred = parse("$" + answer + "$", targets, parsing_timeout=None)
        return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))

    equal("1", "1")   # loads sympy and the parser before the first real call is timed
    if limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _reply({"ready": True, "pid": os.getpid(), "ppid": os.getppid(),
            "reflow_hpc_loaded": any(m.split(".")[0] == "reflow_hpc" for m in sys.modules),
            "limit_as": resource.getrlimit(resource.RLIMIT_AS)[0]})
    for line in sys.stdin:
        try:
            answer, reference = json.loads(line)
            _reply({"ok": equal(str(answer), str(reference))})
        except MemoryError:
            _reply({"ok": False, "exit": "memory"})
            return 0
        except RecursionError:
            _reply({"ok": False})
        except Exception:   # an input the parser or sympy cannot handle is not equivalent
            _reply({"ok": False})
    return 0


if __name__ == "__main__":
    sys.exit(main())
