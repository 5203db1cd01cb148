"""A stand-in for Docker's CLI (no docker here): refuses every flag and form the ``docker`` command
does not take, records each accepted call, and runs it with podman.

``docker ARGS...`` (a wrapper script passes ``sys.argv[1:]``): the subcommand's options are
checked against the options of Docker's CLI reference (docs.docker.com/reference/cli/docker/) that
coderl uses, with their values where Docker restricts them (volume options, tmpfs options,
``import --change`` instructions, ``ps --format`` fields); anything else, a global option before
the subcommand included (``--runtime``, ``--cgroup-manager`` are podman's), exits 125 with
``docker stand-in: refused ...`` on stderr and a ``REFUSED`` line in ``$DOCKER_STANDIN_LOG``. An
accepted call is logged as JSON and run as ``$DOCKER_STANDIN_PODMAN ARGS`` (podman with this
host's runtime flags, what a docker daemon's own configuration holds), translated where the two
differ in meaning: Docker's ``{{.Label "k"}}`` in ``ps --format`` is podman's ``{{index .Labels
"k"}}``, and Docker's ``--tmpfs`` starts empty where podman's copies the image's files up
(podman: ``notmpcopyup``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys

VALUED = {
    "run": {"--name", "--label", "--network", "--hostname", "--memory", "--memory-swap",
            "--pids-limit", "--ulimit", "--log-driver", "--cap-drop", "--security-opt",
            "--tmpfs", "-v", "-w", "-e"},
    "ps": {"--filter", "--format"},
    "rm": set(),
    "create": {"--name"},
    "cp": set(),
    "build": {"--network", "-t", "-f"},
    "import": {"--change", "-c", "-m"},
    "image inspect": {"--format"},
}  # fmt: skip
FLAGS = {
    "run": {"--rm", "-i", "--init", "--read-only", "-d"},
    "ps": {"-a"},
    "rm": {"-f"},
}
VOLUME_OPTIONS = {"ro", "rw", "z", "Z", "shared", "slave", "private", "rshared", "rslave"}
VOLUME_OPTIONS |= {"rprivate", "nocopy", "consistent", "cached", "delegated"}
TMPFS_OPTION = re.compile(r"^(ro|rw|noexec|exec|nosuid|suid|nodev|dev|size=\d+[kmg]?|mode=\d+)$")


def refuse(why: str) -> None:
    log(f"REFUSED {why}")
    print(f"docker stand-in: refused {why}", file=sys.stderr)
    raise SystemExit(125)


def log(line: str) -> None:
    with open(os.environ["DOCKER_STANDIN_LOG"], "a") as f:
        f.write(line + "\n")


def check_value(cmd: str, flag: str, value: str) -> None:
    if flag == "-v":
        parts = value.split(":")
        if len(parts) not in (2, 3) or not parts[0].startswith("/"):
            refuse(f"-v {value!r}: docker takes SRC:DEST[:OPTIONS] with an absolute SRC")
        bad = set(parts[2].split(",")) - VOLUME_OPTIONS if len(parts) == 3 else set()
        if bad:
            refuse(f"-v {value!r}: volume options docker lacks: {sorted(bad)}")
    elif flag == "--tmpfs":
        _, _, opts = value.partition(":")
        bad = [o for o in opts.split(",") if opts and not TMPFS_OPTION.match(o)]
        if bad:
            refuse(f"--tmpfs {value!r}: tmpfs options docker lacks: {bad}")
    elif cmd == "import" and flag in ("--change", "-c"):
        if not re.match(r"^(CMD|ENTRYPOINT|ENV|EXPOSE|LABEL|ONBUILD|USER|VOLUME|WORKDIR) ", value):
            refuse(f"import --change {value!r}: not a Dockerfile instruction")
    elif cmd == "ps" and flag == "--format" and "index .Labels" in value:
        refuse(f"ps --format {value!r}: docker's .Labels is a string, not a map")


def check(args: list[str]) -> list[str]:
    """Refuse what docker would not take; return podman's arguments for the call."""
    if not args or args[0].startswith("-"):
        refuse(f"global options before the subcommand: {args[:2]}")
    cmd, rest = args[0], args[1:]
    if cmd == "image":
        if rest[:1] != ["inspect"]:
            refuse(f"docker has no 'image {rest[:1]}' here")
        cmd, rest = "image inspect", rest[1:]
    if cmd not in VALUED:
        refuse(f"subcommand {cmd!r}")
    out = cmd.split()
    i = 0
    while i < len(rest) and rest[i].startswith("-"):
        flag, eq, value = rest[i].partition("=")
        if flag in VALUED[cmd]:
            if not eq:
                i += 1
                value = rest[i]
            check_value(cmd, flag, value)
            if cmd == "ps" and flag == "--format":
                value = re.sub(r'\.Label "([^"]+)"', r'index .Labels "\1"', value)
            if flag == "--tmpfs":  # docker's tmpfs starts empty; podman's copies the image's up
                value += ",notmpcopyup" if ":" in value else ":notmpcopyup"
            out += [flag, value]
        elif flag in FLAGS.get(cmd, set()) and not eq:
            out.append(flag)
        else:
            refuse(f"{cmd} option {rest[i]!r}")
        i += 1
    return out + rest[i:]


def main() -> None:
    args = sys.argv[1:]
    podman = check(args)
    log(json.dumps(args))
    argv = shlex.split(os.environ["DOCKER_STANDIN_PODMAN"]) + podman
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
