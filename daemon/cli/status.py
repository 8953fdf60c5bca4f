"""`dtnode status`: one node and the swarm it sees, as tables."""

from __future__ import annotations

import json
import os
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich import box, filesize
from rich.console import Console
from rich.table import Table

from dtnode.peers.auth import HTTP_HEADER, SwarmAuth


def _get(base: str, path: str, auth: SwarmAuth | None = None) -> Any:
    headers = {HTTP_HEADER: auth.issue("http", path)} if auth is not None else {}
    with urllib.request.urlopen(urllib.request.Request(base + path, headers=headers), timeout=5) as resp:
        return json.load(resp)


def _wire(last: dict) -> str:
    """How the last round's Δ travelled: the code, bytes per parameter, density, unsent norm."""
    if "compression" not in last:
        return "-"
    text = f"{last['compression']}, {last.get('bytes_per_param', 0):.3g} B/param"
    if last.get("density", 1) < 1:
        text += f", {last['density']:.2%} kept"
    if last.get("feedback_norm") is not None:
        text += f", error feedback {last['feedback_norm']:.3g}"
    return text


def _reachability(status: dict) -> str:
    """A peer's dial-back of the node (swarm/reachability.py), as one cell."""
    if status.get("client_mode"):
        return "client mode (dialled by nobody)"
    found = status.get("reachability")
    if not isinstance(found, dict):
        return "not checked yet (no live peer to ask)"
    parts = [
        f"{name} {'yes' if found.get(error) is None else 'NO: ' + str(found.get(error))}"
        for name, addr, error in (("gRPC", "grpc_addr", "grpc_error"), ("HTTP", "http_addr", "http_error"))
        if found.get(addr)
    ]
    return ", ".join(parts) + f" (by {str(found.get('checked_by', ''))[-10:]})"


def local_node_url(config: str | None, http_port: int | None, status_port: int | None, status_host: str | None) -> str:
    """Where this host's node answers /status: its --status-port listener if it has one, else
    its sidecar. Each value as the node reads it: a flag, else DTNODE_*, else its TOML file."""
    from dtnode.daemon.config.settings import ENV_PREFIX

    path = config or os.environ.get(ENV_PREFIX + "CONFIG")
    try:
        raw = tomllib.loads(Path(path).read_text()) if path else {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        print(f"dtnode: warning: ignoring --config {path}: {e}", file=sys.stderr)
        raw = {}
    file: dict[str, object] = {}
    for key, item in raw.items():  # an option at the top level, or in its group's table ([network])
        table = item if isinstance(item, dict) else {key: item}
        file |= {k.replace("-", "_"): v for k, v in table.items()}

    def value(name: str, given: object) -> object:
        return given if given is not None else os.environ.get(ENV_PREFIX + name.upper(), file.get(name))

    status = value("status_port", status_port)
    if status not in (None, ""):
        return f"http://{value('status_host', status_host) or '127.0.0.1'}:{status}"
    return f"http://127.0.0.1:{value('http_port', http_port) or 7702}"


def watch_status(url: str, every_s: float, auth: SwarmAuth | None = None) -> int:
    """`dtnode status --watch`: the tables redrawn every `every_s` until Ctrl-C; a node that
    stops answering is shown as such, and watched on (it may be restarting)."""
    console = Console()
    try:
        while True:
            with console.capture() as frame:
                show_status(url, auth=auth, console=console)
            console.clear()
            console.print(f"every {every_s:g}s, Ctrl-C to stop · {time.strftime('%H:%M:%S')}")
            console.out(frame.get(), end="")
            time.sleep(every_s)
    except KeyboardInterrupt:
        return 0


def show_status(url: str, as_json: bool = False, auth: SwarmAuth | None = None, console: Console | None = None) -> int:
    """Print the node at `url` and the swarm it sees (tables, or --json); 1 when it does not answer."""
    base = url.rstrip("/")
    err = console.print if console is not None else (lambda text: print(text, file=sys.stderr))
    try:
        status = _get(base, "/status")
    except (urllib.error.URLError, OSError, ValueError) as e:
        err(f"dtnode: error: no node answers at {base}: {getattr(e, 'reason', e)}")
        return 1
    try:
        peers: list[dict[str, Any]] | None = _get(base, "/peers", auth)
    except urllib.error.HTTPError as e:
        if e.code != 401:
            err(f"dtnode: error: {base}/peers answered {e.code}")
            return 1
        peers = None  # a closed swarm, and we hold no key: show the node alone
    except (urllib.error.URLError, OSError, ValueError) as e:
        err(f"dtnode: error: no node answers at {base}: {getattr(e, 'reason', e)}")
        return 1
    if as_json:
        print(json.dumps({"status": status, "peers": peers}, indent=2))
        return 0
    console = console or Console()
    console.print(_node_table(status))
    ranks = status.get("ranks") or []
    if len(ranks) > 1:  # a host training on several devices: one row per local rank
        console.print(_ranks_table(ranks))
    if peers is None:
        console.print(
            "swarm: this node's swarm is closed; pass --swarm-key-file (or set DTNODE_SWARM_KEY) to list its peers"
        )
        return 0
    console.print(_swarm_table(peers, status))
    return 0


def _node_table(status: dict[str, Any]) -> Table:
    """The node itself, a row per fact."""
    node = Table(title=f"node {status['peer_id']}", show_header=False)
    last = status.get("last_round") or {}
    rows = [
        ("condition", f"{status['condition']}: {status['condition_detail']}" if "condition" in status else "-"),
        ("run", status["run_id"]),
        ("state", status["state"]),
        ("outer step", status["outer_step"]),
        ("inner step", status["inner_step"]),
        ("inner lr", _fmt(status.get("inner_lr"), ".3g")),
        ("loss", _fmt(status.get("loss"))),
        ("eval loss", _fmt(status.get("eval_loss"))),
        ("loss floor", _fmt(status.get("loss_floor"))),
        ("tokens/s", f"{status['tokens_per_s']:.0f}"),
        ("in inner steps", _fmt(status.get("compute_utilization"), ".1%")),
        ("uptime", f"{status['uptime_s']:.0f}s"),
        ("params sha256", status["params_sha256"][:16]),
        ("http", status["http_url"]),
        ("reachable", _reachability(status)),
        (
            "last round",
            (
                f"groups {' '.join(str(h['group_size']) for h in last.get('hops', [])) or '-'}, "
                f"{last.get('duration_s', '-')}s, all-reduce {last.get('allreduce_s', '-')}s, "
                f"sent {last.get('bytes_sent', '-')} B"
            ),
        ),
        ("wire", _wire(last)),
    ]
    for key, value in rows:
        node.add_row(key, str(value))
    return node


def _ranks_table(ranks: list[dict[str, Any]]) -> Table:
    """A multi-rank host's local ranks, one row each."""
    table = Table(title=f"local ranks: {len(ranks)}")
    for col in ("rank", "device", "state", "tokens/s", "step", "memory", "GPU peak", "restarts"):
        table.add_column(col)
    for r in ranks:
        table.add_row(
            str(r["rank"]),
            r["device"],
            r["state"],
            f"{r['tokens_per_s']:.0f}",
            f"{r['step_seconds']:.3f}s",
            filesize.decimal(r["memory_bytes"]),
            filesize.decimal(r["device_memory_bytes"]) if r["device_memory_bytes"] else "-",
            str(r["restarts"]),
        )
    return table


def _swarm_table(peers: list[dict[str, Any]], status: dict[str, Any]) -> Table:
    """The peers this node sees: the columns an operator compares across peers, within an
    80-column terminal (addresses, devices, checkpoints and client modes are in --json and on
    the dashboard)."""
    swarm = Table(title=f"swarm: {len(peers)} peers", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0))
    for col in ("peer", "state", "round", "step", "lag", "θ_g", "loss", "condition", "tok/s", "seen"):
        swarm.add_column(col, no_wrap=True)
    for p in peers:
        where = str(p["round"]) if p.get("round", -1) >= 0 else "-"
        seen = f"{p['last_seen_s']:.0f}s" if "last_seen_s" in p else "-"
        swarm.add_row(
            p["peer_id"][-8:],
            p["state"] + ("/client" if p["client_mode"] else ""),
            where,
            str(p["outer_step"]),
            str(p.get("lag", "-")),
            _theta(p, status),
            _fmt(p.get("loss"), ".3f"),
            p.get("condition") or "-",
            f"{p['tokens_per_s']:.0f}",
            seen,
        )
    swarm.caption = "θ_g: the start of its hash; * at this node's step with another θ_g"
    return swarm


def _theta(peer: dict[str, Any], status: dict[str, Any]) -> str:
    """A peer's θ_g hash, short; marked when it is at this node's step with another θ_g."""
    theta = str(peer.get("theta_sha256") or "")
    if not theta:
        return "-"
    other = peer.get("outer_step") == status.get("outer_step") and theta != status.get("params_sha256", theta)
    return theta[:8] + ("*" if other else "")


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)
