"""``docker``-compatible command line that runs commands in a gateway episode's coderl sandbox.

Standard library only: the gateway (:mod:`coderl.envs.gateway`) copies this file, executable,
into each episode's directory and hands its path to the agent program as ``$CODERL_EXEC`` (and
``$MSWEA_DOCKER_EXECUTABLE``, the knob mini-swe-agent's ``docker`` environment reads), so a
harness that runs its commands through ``docker`` runs them in the sandbox instead, unmodified.
It reads ``$CODERL_SANDBOX_URL`` (the episode's secret exec endpoint).

The subset of ``docker`` it speaks (anything else exits 2 with a message):

- ``run -d [OPTIONS] IMAGE [CMD...]``: the sandbox already runs; prints its id.
- ``exec [-w DIR] [-e KEY=VALUE]... [-i] [-t] ID CMD...``: runs ``CMD`` (an argument vector, e.g.
  ``bash -lc 'ls'``) in ``DIR`` inside the sandbox with the variables set; prints its output
  (stdout and stderr merged) and exits with its status.
- ``stop ID``, ``rm [-f] ID``, ``kill ID``: nothing to do (the gateway closes the sandbox).
"""

import json
import os
import sys
import urllib.error
import urllib.request

SANDBOX_ID = "coderl-sandbox"


def _exec(args: list[str]) -> int:
    cwd, env = "", {}
    while args and args[0].startswith("-"):
        flag = args.pop(0)
        if flag in ("-w", "--workdir"):
            cwd = args.pop(0)
        elif flag in ("-e", "--env"):
            key, _, value = args.pop(0).partition("=")
            env[key] = value
        elif flag not in ("-i", "-t", "-it", "--interactive", "--tty"):
            print(f"coderl sandbox exec: unsupported option {flag}", file=sys.stderr)
            return 2
    if len(args) < 2:
        print("coderl sandbox exec: usage: exec [-w DIR] [-e K=V]... ID CMD...", file=sys.stderr)
        return 2
    body = json.dumps({"argv": args[1:], "cwd": cwd, "env": env}).encode()
    req = urllib.request.Request(
        os.environ["CODERL_SANDBOX_URL"], body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        print(f"coderl sandbox exec: {e.code} {e.read().decode(errors='replace')}", file=sys.stderr)
        return 125
    sys.stdout.write(out["output"])
    return int(out["returncode"])


def main(argv: list[str]) -> int:
    if not argv:
        print("coderl sandbox: a docker-compatible subset (run, exec, stop, rm)", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "exec":
        return _exec(rest)
    if command == "run":
        print(SANDBOX_ID)
        return 0
    if command in ("stop", "rm", "kill"):
        return 0
    print(f"coderl sandbox: {command!r} is not supported (run, exec, stop, rm)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
