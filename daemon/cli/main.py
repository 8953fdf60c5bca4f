"""The `dtnode` command: join, local, status, export.

Node options are generated from NodeSettings, so the flags, their help texts and the
DTNODE_* variables can never drift apart. A flag is passed on only when given, which is
what lets env vars and the TOML file fill in the rest.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import sys
from collections.abc import Collection
from enum import Enum
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from dtnode import __version__
from dtnode.daemon.config.settings import (
    ENV_PREFIX,
    NodeSettings,
    SettingsError,
    flag,
    load_settings,
    option_groups,
)
from dtnode.daemon.config.sources import TOP_LEVEL

EXIT_USAGE = 2
EXIT_JOIN = 3  # the DHT or the --peer addresses could not be reached (a restart may help)
EXIT_MISMATCH = 4  # the swarm trains another model, recipe or run (a restart cannot help)
# Secrets: read from the environment or a file, never from argv (visible in `ps`).
ENV_ONLY = {"swarm_key"}
# Options that `dtnode local` sets per node itself.
LOCAL_MANAGED = {
    "peers",
    "new_swarm",
    "state_dir",
    "host",
    "announce_host",
    "dht_port",
    "grpc_port",
    "http_port",
    "min_peers",
}


Subcommands = argparse._SubParsersAction  # what add_subparsers returns: one add_parser per command


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def add_node_options(
    parser: argparse.ArgumentParser, skip: Collection[str] = frozenset(), show_all: bool = False
) -> None:
    """The settings as flags, one help section per group of NodeSettings, in its order; a group's
    advanced flags are parsed always and listed only with --help-all (`--config` ends the
    operations section, which is where a supervisor looks for it)."""
    for attribute, group_model in option_groups():
        names = [name for name in group_model.model_fields if name not in skip and name not in ENV_ONLY]
        names += sorted(TOP_LEVEL - set(skip)) if attribute == "operations" else []
        if not names:
            continue
        group = parser.add_argument_group(group_model.TITLE, group_model.HELP)
        for name in names:
            _add_option(group, name, show_all or name not in group_model.ADVANCED)


def _add_option(group: argparse._ArgumentGroup, name: str, shown: bool) -> None:
    field = NodeSettings.option(name)
    default = field.get_default(call_default_factory=True)
    default_text = "none" if default in (None, []) else default.value if isinstance(default, Enum) else default
    help_text = (
        f"{field.description} (default: {default_text}; env {ENV_PREFIX}{name.upper()})" if shown else argparse.SUPPRESS
    )
    if name == "peers":
        group.add_argument(
            "--peer", dest="peers", action="append", metavar="ADDRESS", default=argparse.SUPPRESS, help=help_text
        )
    elif _is_bool(field.annotation):
        group.add_argument(
            flag(name), dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
        )
    else:
        choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else None
        metavar = "{" + ",".join(choices) + "}" if choices else name.upper()
        group.add_argument(flag(name), dest=name, metavar=metavar, default=argparse.SUPPRESS, help=help_text)


class HelpAll(argparse.Action):
    """`--help-all`: the help with every option group, tuning and test knobs included."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any):
        super().__init__(option_strings, dest=dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        command = parser.prog.split()[-1]  # join or local: the same subcommand, every group shown
        full = build_parser(show_all=True)._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr,index]
        full.print_help()
        parser.exit()


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    """The CLI; `show_all` lists the tuning and test knobs in the help too (`--help-all`)."""
    parser = argparse.ArgumentParser(prog="dtnode", description="Fault-tolerant peer-to-peer DiLoCo training node.")
    parser.add_argument("--version", action="version", version=f"dtnode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_join(sub, show_all)
    _add_local(sub, show_all)
    _add_status(sub)
    _add_export(sub)
    return parser


def _add_join(sub: Subcommands, show_all: bool) -> None:
    join = sub.add_parser(
        "join",
        usage="dtnode join (--peer ADDRESS | --new-swarm) [--data PATH] [--model MODEL] [--gpus all|0,1,...] [options]",
        help="run a node: join a swarm with --peer, or start one with --new-swarm",
        description="Run one node: `dtnode join --peer http://HOST:7702` joins the swarm of that "
        "node; `dtnode join --new-swarm` starts a swarm and prints the `dtnode join --peer ...` "
        "line other hosts use. Options also come from DTNODE_<NAME> variables and a --config "
        "TOML file (flags win, then variables, then the file).",
        epilog=None
        if show_all
        else "Tuning and test knobs (matchmaking windows, chunk sizes, kernels) are listed by --help-all.",
    )
    join.add_argument("--help-all", action=HelpAll, help="show every option, tuning and test knobs included")
    add_node_options(join, show_all=show_all)


def _add_local(sub: Subcommands, show_all: bool) -> None:
    local = sub.add_parser(
        "local",
        help="run a whole swarm of N nodes on this host",
        description="Start N node processes on loopback (ports picked automatically), "
        "their logs prefixed by node. Ctrl-C stops them all.",
    )
    local.add_argument("--nodes", type=int, default=3, help="number of node processes (default: 3)")
    local.add_argument(
        "--base-dir", default="state/local", help="state dirs go to BASE_DIR/nodeI (default: state/local)"
    )
    local.add_argument(
        "--http-port",
        type=int,
        default=7702,
        help="node I serves its status and dashboard on HTTP_PORT+I, on 127.0.0.1 (default: 7702; 0: any free port)",
    )
    local.add_argument("--help-all", action=HelpAll, help="show every option, tuning and test knobs included")
    add_node_options(local, skip=LOCAL_MANAGED, show_all=show_all)


def _add_status(sub: Subcommands) -> None:
    status = sub.add_parser(
        "status",
        help="show a node and its swarm as a table",
        description="Show a node and the peers it sees: who is at which outer step, on which θ_g, "
        "with what loss and condition. Without --url it asks the node of this host, where "
        "--status-port, --status-host and --http-port (flags, DTNODE_* variables or --config) "
        "say it listens.",
    )
    status.add_argument("--url", default=None, help="the node's sidecar (or --status-port) URL")
    status.add_argument(
        "--config", default=None, help="the node's TOML file, to find its ports (default: DTNODE_CONFIG)"
    )
    status.add_argument("--http-port", type=int, default=None, help="the node's --http-port (default: 7702)")
    status.add_argument("--status-port", type=int, default=None, help="the node's --status-port, if it has one")
    status.add_argument("--status-host", default=None, help="the node's --status-host (default: 127.0.0.1)")
    status.add_argument("--json", action="store_true", help="print the raw JSON instead of tables")
    status.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C",
    )
    status.add_argument(
        "--swarm-key-file",
        default=None,
        help="the swarm key, to list a closed swarm's peers (default: DTNODE_SWARM_KEY if set)",
    )


def _add_export(sub: Subcommands) -> None:
    export = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face save_pretrained directory",
        description="Write θ_g of a checkpoint in a node's state dir as a directory that "
        "transformers' AutoModelForCausalLM.from_pretrained and "
        "AutoTokenizer.from_pretrained load.",
    )
    export.add_argument("--state-dir", required=True, type=Path, help="the node's state dir")
    export.add_argument("--out", required=True, type=Path, help="the directory to write")
    export.add_argument("--step", type=int, default=None, help="outer step to export (default: the newest)")
    export.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="the run's --tokenizer, to include it (default: the one the node noted in its "
        "state dir; byte-level runs get a byte tokenizer)",
    )
    export.add_argument(
        "--model",
        default=None,
        help="the run's --model, needed only for a module:factory model, and for an hf:DIR "
        "model that started from weights and has frozen parameters (default: the one "
        "the node noted in its state dir)",
    )


def _node_values(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k in NodeSettings.GROUP_OF or k in TOP_LEVEL}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: what log collectors (Loki, Elasticsearch, journald) parse without rules."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class ClosedListenerFilter(logging.Filter):
    """p2pd (the DHT's libp2p daemon) logs `ERROR error accepting connection: ... use of closed
    network connection` when its listener is closed under it: that is every clean stop, not a
    fault, and an ERROR line in a clean stop's log sends operators looking for one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "use of closed network connection" not in record.getMessage()


def configure_logging(level: str, log_format: str = "human") -> None:
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler])
    from dtnode.peers.hivemind_adapter import P2P_DAEMON_LOGGER, log_through_root

    log_through_root()  # hivemind's lines go through this handler too, in the same format
    logging.getLogger(P2P_DAEMON_LOGGER).addFilter(ClosedListenerFilter())
    # grpc's own debug lines are about its internals: a "Loaded running loop" per call, and the
    # traceback of a request iterator cut short when a reducer refused the stream (a refusal this
    # node logs itself), which read in a --log-level DEBUG run like a bug of ours
    for noisy in ("hivemind", "aiohttp.access", "asyncio", "grpc"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLevelName(level)))


def require_a_swarm(settings: NodeSettings) -> None:
    """A node with no --peer either rejoins the peers its state dir knows (a restart) or, given
    --new-swarm, starts a swarm. Anything else is a typo or a missing option: training alone in
    a swarm of one, silently, is the wrong answer to it (Petals asks for --new_swarm too)."""
    if settings.swarm.peers or settings.swarm.new_swarm:
        return
    from dtnode.peers.known_peers import FILE_NAME, KnownPeers

    if KnownPeers(settings.checkpoints.state_dir / FILE_NAME).load().peers:
        return
    raise SettingsError(
        "--peer",
        "no swarm to join: give a member's address (--peer http://HOST:7702, its sidecar; or its "
        "/ip4/.../p2p/... multiaddr), or --new-swarm to start a new swarm here",
    )


def cmd_join(args: argparse.Namespace) -> int:
    settings = load_settings(_node_values(args))
    require_a_swarm(settings)
    configure_logging(settings.operations.log_level, settings.operations.log_format)
    import uvloop

    from dtnode.daemon.node import run_node
    from dtnode.peers.membership import JoinError, SwarmMismatch

    # The event loop serves peers (streams, DHT, HTTP) while other threads run Python (torch's
    # imports, checkpoint work): it waits for the GIL at most this long instead of 5 ms a time.
    sys.setswitchinterval(0.001)
    from dtnode.daemon.training.ranks.host import HostRestartNeeded

    try:
        return uvloop.run(run_node(settings))
    except SwarmMismatch as e:
        print(f"dtnode: error: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    except JoinError as e:
        print(f"dtnode: error: {e}", file=sys.stderr)
        return EXIT_JOIN
    except HostRestartNeeded as e:  # a supervisor restarts it (exit 1, unlike a usage error's 2)
        print(f"dtnode: error: {e}", file=sys.stderr)
        return 1


def cmd_local(args: argparse.Namespace) -> int:
    values = _node_values(args)
    settings = load_settings(values)  # fail fast, before any process starts
    if args.nodes < 1 or args.nodes > 64:
        raise SettingsError("--nodes", "must be between 1 and 64")
    from dtnode.daemon.cli.local_swarm import finished_before, run_local, threads_per_rank

    if (reached := finished_before(Path(args.base_dir), settings.diloco.max_rounds)) is not None:
        raise SettingsError(
            "--max-rounds",
            f"the swarm in {args.base_dir} already reached outer step {reached}, the run's last "
            f"({settings.diloco.max_rounds}): nothing to train; give a larger --max-rounds to go on, "
            f"or another --base-dir (or remove {args.base_dir}) to start over",
        )

    if settings.hardware.threads_per_rank is None:  # not given on the command line, in DTNODE_* or the TOML file
        ranks = settings.hardware.nproc_per_node or 1
        values["threads_per_rank"] = threads_per_rank(args.nodes, ranks, os.cpu_count() or 1)
    if args.http_port and not 1024 <= args.http_port <= 65535 - args.nodes:
        raise SettingsError("--http-port", f"must be 0 or 1024..{65535 - args.nodes}")
    from dtnode.peers.server import port_in_use

    for i in range(args.nodes if args.http_port else 0):
        if port_in_use("127.0.0.1", args.http_port + i):
            raise SettingsError(
                "--http-port",
                f"port {args.http_port + i} (node{i}) on 127.0.0.1 is in use (another "
                "dtnode local?); choose another base port, or 0 for any free ones",
            )
    return run_local(args.nodes, args.base_dir, values, args.http_port)


def cmd_status(args: argparse.Namespace) -> int:
    from dtnode.daemon.cli.status import local_node_url, show_status, watch_status
    from dtnode.peers.auth import AuthError, SwarmAuth, load_swarm_key

    if args.watch is not None and not 0.2 <= args.watch <= 3600:
        raise SettingsError("--watch", "must be between 0.2 and 3600 seconds")
    url = args.url or local_node_url(args.config, args.http_port, args.status_port, args.status_host)
    try:
        key = load_swarm_key(args.swarm_key_file)
    except AuthError as e:
        print(f"dtnode: error: --swarm-key-file: {e}", file=sys.stderr)
        return EXIT_USAGE
    auth = SwarmAuth(key, "dtnode-status") if key else None
    if args.watch is not None:
        return watch_status(url, args.watch, auth=auth)
    return show_status(url, as_json=args.json, auth=auth)


def cmd_export(args: argparse.Namespace) -> int:
    configure_logging("INFO")
    from dtnode.daemon.checkpoints.file_format import CheckpointError
    from dtnode.daemon.cli.export import export_checkpoint
    from dtnode.daemon.workload.hf_model import HFModelError

    try:
        out = export_checkpoint(args.state_dir, args.out, args.step, args.tokenizer, args.model)
    except (CheckpointError, HFModelError) as e:
        print(f"dtnode: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"exported to {out}: AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def _unrecognized(
    parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str], words: list[str]
) -> None:
    """argparse reports a stray word with the top-level usage; this names the subcommand's, and
    says how an on/off option is written (`--client-mode yes` is `--client-mode`)."""
    command = parser._subparsers._group_actions[0].choices[args.command]  # type: ignore[union-attr,index]
    hint = ""
    before = _word_before(extra[0], words)
    if before and before.startswith("--") and before.lstrip("-").replace("-", "_").removeprefix("no_") in BOOL_FIELDS:
        name = before.lstrip("-").removeprefix("no-")
        hint = f" (--{name} takes no value: write --{name} to turn it on, --no-{name} to turn it off)"
    command.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


def _word_before(word: str, words: list[str]) -> str | None:
    return words[words.index(word) - 1] if word in words and words.index(word) > 0 else None


BOOL_FIELDS = {name for name in NodeSettings.GROUP_OF if _is_bool(NodeSettings.option(name).annotation)}


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _unrecognized(parser, args, extra, sys.argv[1:] if argv is None else argv)
    try:
        return {"join": cmd_join, "local": cmd_local, "status": cmd_status, "export": cmd_export}[args.command](args)
    except SettingsError as e:
        print(f"dtnode: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
