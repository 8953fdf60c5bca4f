"""Deploy files cannot be run here (no Docker engine); they are parsed and checked instead."""

import configparser
import tomllib
from pathlib import Path

import yaml  # installed with hivemind

from dtnode.daemon.config.settings import NodeSettings
from dtnode.daemon.workload.recipe import SwarmRecipe
from dtnode.peers.sidecar_address import is_sidecar_address

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_example_config_is_valid_settings_and_leaves_the_recipe_to_the_swarm():
    """Values from a config file count as given: an example that set the run id, the model or H
    never joined another swarm (exit 4, and a unit restarting it every 10 s). It names a peer's
    sidecar and sets none of them, so it joins whatever that peer trains."""
    settings = NodeSettings(config=DEPLOY / "node.example.toml")
    recipe = set(SwarmRecipe.model_fields) | {"run_id", "model", "tokenizer"}
    assert not recipe & settings.given(), recipe & settings.given()
    assert settings.swarm.peers and all(is_sidecar_address(p) for p in settings.swarm.peers)


def test_systemd_unit_runs_join_with_config():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "dtnode.service")
    assert unit["Service"]["ExecStart"].endswith("dtnode join")
    assert "DTNODE_CONFIG=" in unit["Service"]["Environment"]
    assert unit["Service"]["KillSignal"] == "SIGTERM"


def test_dockerfile_and_compose_reference_real_commands():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["dtnode"]' in dockerfile and "/healthz" in dockerfile
    compose = (DEPLOY / "docker-compose.yml").read_text()
    services = yaml.safe_load(compose)["services"]
    assert set(services) == {"node1", "node2", "node3"}
    for service in services.values():
        assert service["command"][0] == "join" and service["environment"]["DTNODE_RUN_ID"] == "compose-demo"


# ---- every deploy file parses, and uses only options, settings and metrics that exist ----------

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest

from dtnode.daemon.cli.main import EXIT_JOIN, EXIT_MISMATCH, EXIT_USAGE, build_parser
from dtnode.daemon.telemetry.metrics import NodeMetrics

MANIFESTS = ("statefulset.yaml", "gpu-host.yaml", "host-network.yaml")


def _statefulset(manifest: str) -> dict:
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / manifest).read_text()))
    return next(d for d in docs if d["kind"] == "StatefulSet")


JOIN_OPTIONS = {
    opt
    for action in build_parser()._subparsers._group_actions[0].choices["join"]._actions
    for opt in action.option_strings
}
ENV_FIELDS = {"DTNODE_" + name.upper() for name in [*NodeSettings.GROUP_OF, "config"]}


def _join_flags(argv: list[str]) -> list[str]:
    assert argv and argv[0] == "join", argv
    return [a.split("=", 1)[0] for a in argv[1:] if a.startswith("--")]


def _dtnode_commands() -> dict[str, list[str]]:
    """Every `dtnode join ...` command line in the deploy files, by where it is."""
    out = {}
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        out[f"compose {name}"] = service["command"]
    for manifest in MANIFESTS:
        sts = _statefulset(manifest)
        script = sts["spec"]["template"]["spec"]["containers"][0]["args"][0]
        for i, line in enumerate(re.findall(r"exec dtnode (join[^\n]*)", script)):
            out[f"{manifest} line {i}"] = shlex.split(
                line.replace('"$POD_IP"', "10.0.0.1").replace('"$HOST_IP"', "10.0.0.2")
            )
    for unit_file in ("dtnode.service", "dtnode-gpu-host.service"):
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.read(DEPLOY / unit_file)
        out[unit_file] = shlex.split(unit["Service"]["ExecStart"])[1:]
    cmd = re.search(r"^CMD (\[.*\])$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE).group(1)
    out["Dockerfile"] = json.loads(cmd)
    return out


def test_every_option_the_deploy_files_use_exists():
    commands = _dtnode_commands()
    assert len(commands) >= 7
    for where, argv in commands.items():
        unknown = [f for f in _join_flags(argv) if f not in JOIN_OPTIONS]
        assert not unknown, f"{where} uses options dtnode join does not have: {unknown}"


def _deploy_environment(where: str) -> dict[str, str]:
    """The DTNODE_* values a deploy file gives the command line named `where`."""
    env: dict[str, str] = {}
    if where.startswith("compose"):
        compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
        env = {k: str(v) for k, v in compose["services"][where.split()[1]].get("environment", {}).items()}
    elif where.endswith(".service"):
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.read(DEPLOY / where)
        env = dict(a.split("=", 1) for a in shlex.split(unit["Service"]["Environment"]))
        env["DTNODE_CONFIG"] = str(DEPLOY / "node.example.toml")  # what the guide installs as /etc/dtnode/node.toml
    elif where.split()[0] in MANIFESTS:
        container = _statefulset(where.split()[0])["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e and e["name"].startswith("DTNODE_")}
    env.pop("DTNODE_REQUIRE_SWARM_KEY", None)  # the secret is not here
    env.pop("DTNODE_STATE_DIR", None)
    return {k: v for k, v in env.items() if k.startswith("DTNODE_")}


def test_every_deploy_command_line_starts_a_node_on_a_fresh_state_dir(monkeypatch, tmp_path):
    """Each command line with its file's environment, through dtnode's parser and settings, on a
    state dir that knows no peer (a first start): it joins a swarm or starts one. compose's
    node1 and pod 0 once started no swarm (join without --peer needs --new-swarm now)."""
    from dtnode.daemon.cli.main import _node_values, require_a_swarm
    from dtnode.daemon.config.settings import load_settings

    for where, argv in _dtnode_commands().items():
        if where == "Dockerfile":
            continue  # the image's default CMD: `docker run IMAGE join --peer ...` gives the rest
        for name in [n for n in os.environ if n.startswith("DTNODE_") and not n.startswith("DTNODE_TEST_")]:
            monkeypatch.delenv(name)
        for name, value in _deploy_environment(where).items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("DTNODE_STATE_DIR", str(tmp_path / where.replace(" ", "-")))
        settings = load_settings(_node_values(build_parser().parse_args(argv)))
        require_a_swarm(settings)  # raises for a node that would neither join nor start a swarm


def test_every_setting_the_deploy_files_set_through_the_environment_exists():
    texts = {p.name: p.read_text() for p in DEPLOY.rglob("*") if p.is_file()}
    used = {(name, v) for name, text in texts.items() for v in re.findall(r"\bDTNODE_[A-Z_]+\b", text)}
    assert used
    unknown = {(name, v) for name, v in used if v not in ENV_FIELDS}
    assert not unknown, unknown


def test_compose_joins_by_sidecar_address_with_no_peer_id():
    text = (DEPLOY / "docker-compose.yml").read_text()
    assert "/p2p/" not in text and "PEER_ID" not in text
    services = yaml.safe_load(text)["services"]
    assert "--peer" not in services["node1"]["command"]
    for name in ("node2", "node3"):
        command = services[name]["command"]
        assert command[command.index("--peer") + 1] == "http://node1:7702"


def test_the_image_installs_the_torch_that_pyproject_floors_and_ci_tests():
    """The base once was pytorch/pytorch:2.5.1 while the code imports fully_shard (public from
    torch 2.6) and CI installed 2.13: the image's torch is now one ARG, the pyproject floor the
    same version, and .ci/image-env reads it from the Dockerfile."""
    text = (DEPLOY / "Dockerfile").read_text()
    version = re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.MULTILINE).group(1)
    assert 'pip install "torch==${TORCH_VERSION}"' in text
    deps = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in deps if d.startswith("torch"))
    assert floor == "torch>=" + version.removesuffix(".0"), (floor, version)
    assert "TORCH_VERSION" in (DEPLOY.parent / ".ci" / "image-env").read_text()


def test_dockerfile_is_non_root_with_a_state_volume_and_healthcheck():
    text = (DEPLOY / "Dockerfile").read_text()
    user = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert user and user[-1] not in ("root", "0")
    assert re.search(r"^VOLUME /var/lib/dtnode", text, re.MULTILINE) and "/healthz" in text
    assert 'ENTRYPOINT ["dtnode"]' in text


def test_systemd_unit_restarts_and_is_sandboxed():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "dtnode.service")
    service = unit["Service"]
    assert service["User"] == "dtnode" and service["Restart"] == "on-failure"
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert service["StateDirectory"] == "dtnode"


@pytest.mark.parametrize("unit_file", ["dtnode.service", "dtnode-gpu-host.service"])
def test_systemd_units_never_restart_a_node_that_a_restart_cannot_mend(unit_file):
    """A usage error (2) and a swarm that trains another model, recipe or run (4) fail the same
    way on every start: a unit that restarted them every 10 s would spin forever. A lost
    connection (3) and a sharded host's lost rank (1) are restarted."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / unit_file)
    prevented = {int(code) for code in unit["Service"]["RestartPreventExitStatus"].split()}
    assert prevented == {EXIT_USAGE, EXIT_MISMATCH} and EXIT_JOIN not in prevented


def test_statefulset_requests_a_gpu_keeps_state_and_probes_the_sidecar():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "statefulset.yaml").read_text()))
    assert {d["kind"] for d in docs} == {"Service", "StatefulSet"}
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "state"
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_liveness_and_readiness_are_different_questions(manifest):
    """Liveness (/healthz) restarts a process that stopped working; readiness (/readyz) says it
    is in the swarm. One endpoint for both restarted nothing that averaged alone for hours."""
    container = _statefulset(manifest)["spec"]["template"]["spec"]["containers"][0]
    assert container["startupProbe"]["httpGet"]["path"] == container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_every_manifest_says_how_to_create_the_secret_it_needs(manifest):
    text = (DEPLOY / "kubernetes" / manifest).read_text()
    secret = _statefulset(manifest)["spec"]["template"]["spec"]["containers"][0]["env"]
    name = next(e for e in secret if e["name"] == "DTNODE_SWARM_KEY")["valueFrom"]["secretKeyRef"]["name"]
    assert f"kubectl create secret generic {name} --from-literal=key=" in text
    assert f"kubectl create secret generic {name}" in (DEPLOY.parent / "README.md").read_text()


def test_the_host_network_manifest_is_reachable_from_outside_the_cluster():
    """statefulset.yaml's pods announce pod IPs behind a headless Service: nothing outside can
    dial them. This one uses the node's network and announces the node's address."""
    pod = _statefulset("host-network.yaml")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert (
        {p["containerPort"] for p in container["ports"]}
        == {p["hostPort"] for p in container["ports"]}
        == {
            7700,
            7701,
            7702,
        }
    )
    host_ip = next(e for e in container["env"] if e["name"] == "HOST_IP")
    assert host_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert all(
        '--announce-host "$HOST_IP"' in line for line in container["args"][0].splitlines() if "exec dtnode" in line
    )
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"


@pytest.mark.parametrize("manifest", ["statefulset.yaml", "gpu-host.yaml"])
def test_a_missing_swarm_key_secret_fails_the_start(manifest):
    """Issue 31, finding 15: the key secret is optional (a pod still starts without it), so the
    manifests ask the node to refuse to start without a key rather than run an open swarm."""
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / manifest).read_text()))
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["DTNODE_SWARM_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "dtnode-swarm-key"
    assert env["DTNODE_REQUIRE_SWARM_KEY"]["value"] == "true"


def test_the_gpu_host_unit_and_manifest_give_one_peer_every_gpu():
    """A multi-GPU host: DTNODE_GPUS=all, the node alone gets SIGTERM (it kills its ranks), the
    pod asks for its 8 GPUs in requests and limits alike and gives NCCL a memory-backed /dev/shm."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "dtnode-gpu-host.service")
    service = unit["Service"]
    assert "DTNODE_GPUS=all" in service["Environment"] and service["KillMode"] == "mixed"
    assert service["NoNewPrivileges"] == "yes" and service["TimeoutStopSec"] == "120"
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "gpu-host.yaml").read_text()))
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert (
        container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"] == 8
    )
    assert {"name": "DTNODE_GPUS", "value": "all"} in container["env"]
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert (
        shm["emptyDir"]["medium"] == "Memory" and {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    )
    service_doc = next(d for d in docs if d["kind"] == "Service")
    assert sts["spec"]["serviceName"] == service_doc["metadata"]["name"] == "dtnode-gpu"


def _metric_names_in(text: str) -> set[str]:
    return set(re.findall(r"\b((?:dtnode|process)_[a-z_]+)\b", text))


@pytest.fixture(scope="module")
def exported_names() -> set[str]:
    """Sample names a node exports, labelled families included before their first sample."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}
    registry = NodeMetrics("0", "run", "tiny", "cpu").registry
    return {sample.name for family in registry.collect() for sample in family.samples} | {
        family.name + suffix for family in registry.collect() for suffix in suffixes.get(family.type, ("",))
    }


def test_alert_rules_and_scrape_config_parse_and_name_real_metrics(exported_names):
    for name in ("prometheus.yml", "kubernetes.yml"):
        config = yaml.safe_load((DEPLOY / "prometheus" / name).read_text())
        assert config["rule_files"] == ["alerts.yml"]
        assert all(job["metrics_path"] == "/metrics" for job in config["scrape_configs"] if "metrics_path" in job)
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} >= {
        "DtnodeDown",
        "DtnodeNoProgress",
        "DtnodeNeverRounded",
        "DtnodeAlone",
        "DtnodeThetaDiverged",
        "DtnodeUnreachable",
    }
    for rule in rules:
        unknown = _metric_names_in(rule["expr"]) - exported_names
        assert not unknown, f"{rule['alert']} names metrics no node exports: {unknown}"


def test_grafana_dashboard_parses_and_names_real_metrics(exported_names):
    dashboard = json.loads((DEPLOY / "grafana" / "dtnode.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        unknown = _metric_names_in(expr) - exported_names
        assert not unknown, f"{expr} names metrics no node exports: {unknown}"


# ---- what issue 34 found: the image, the systemd guide and the manifest as written -----------


def _unit() -> configparser.SectionProxy:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(DEPLOY / "dtnode.service")
    return unit["Service"]


def test_the_systemd_unit_s_exec_start_and_environment_parse_as_dtnode_settings(monkeypatch):
    """ExecStart through the CLI's own parser, with the unit's Environment= (its config file the
    example the guide installs), gives the settings the guide means."""
    from dtnode.daemon.cli.main import _node_values
    from dtnode.daemon.config.settings import load_settings

    service = _unit()
    for assignment in shlex.split(service["Environment"]):
        name, value = assignment.split("=", 1)
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DTNODE_CONFIG", str(DEPLOY / "node.example.toml"))  # installed to /etc/dtnode/node.toml
    argv = shlex.split(service["ExecStart"])
    assert argv[0] == "/opt/dtnode/.venv/bin/dtnode"
    settings = load_settings(_node_values(build_parser().parse_args(argv[1:])))
    assert settings.operations.log_format == "json" and str(settings.checkpoints.state_dir) == "/var/lib/dtnode"
    assert (
        settings.swarm.peers == ["http://node1.example.org:7702"] and settings.hardware.batch_size == 32
    )  # from the config file


def test_the_systemd_guide_installs_from_a_clone_with_install_d():
    guide = [line.lstrip("# ").strip() for line in (DEPLOY / "dtnode.service").read_text().splitlines()]
    steps = [line for line in guide if line.startswith(("git ", "python3 ", "/opt/", "install ", "systemctl "))]
    assert any(s.startswith("git clone ") for s in steps)
    assert not any("pip install dtnode" in s for s in steps)  # not on a package index
    assert any("pip install '/opt/dtnode/src[hf]'" in s for s in steps)
    installs = [s for s in steps if s.startswith("install ")]
    assert installs and all(" -D " in s for s in installs)  # creates /etc/dtnode
    assert any(s.endswith("/etc/systemd/system/dtnode.service") for s in installs)


def test_the_image_has_the_hf_extra_a_compiler_and_every_file_the_package_needs():
    text = (DEPLOY / "Dockerfile").read_text()
    assert 'pip install ".[hf]"' in text and re.search(r"apt-get install[^\n]* gcc g\+\+", text)
    copied = {src for line in re.findall(r"^COPY (.+)$", text, re.MULTILINE) for src in line.split()[:-1]}
    pyproject = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())
    packages = {p.split(".")[1] for p in pyproject["tool"]["setuptools"]["packages"] if "." in p}
    assert packages <= copied and {"pyproject.toml", pyproject["project"]["readme"], "__init__.py"} <= copied


def test_the_manifest_names_a_pushed_image_a_pull_policy_and_waits_for_tokenization():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "statefulset.yaml").read_text()))
    container = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    registry, _, rest = container["image"].partition("/")
    assert "." in registry and rest and not container["image"].endswith(":latest")  # a registry, a release tag
    assert container["imagePullPolicy"] in ("IfNotPresent", "Always")
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600


def test_every_gpu_docker_run_line_shares_the_hosts_ipc_namespace():
    """NCCL moves data between a host's ranks through /dev/shm, which Docker caps at 64 MB unless
    the container shares the host's IPC namespace: every `docker run --gpus` line shown says so."""
    root = DEPLOY.parent
    files = [DEPLOY / "Dockerfile", root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    lines = [line for f in files for line in f.read_text().splitlines() if "docker run" in line and "--gpus" in line]
    assert lines and all("--ipc=host" in line for line in lines), lines


@pytest.mark.parametrize("manifest", MANIFESTS)
def test_the_kubernetes_scrape_config_keeps_every_manifests_pods(manifest):
    """prometheus.yml kept pods labelled `dtnode` while gpu-host.yaml's were `dtnode-gpu`: the
    8-GPU pods were never scraped. The relabelling is applied here to each pod template."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "kubernetes.yml").read_text())
    job = next(j for j in config["scrape_configs"] if "kubernetes_sd_configs" in j)
    template = _statefulset(manifest)["spec"]["template"]["metadata"]
    meta = {"__address__": "10.0.0.1"}
    for key, value in template["labels"].items():
        meta["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    for key, value in template["annotations"].items():
        meta["__meta_kubernetes_pod_annotation_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)] = str(value)
    for rule in job["relabel_configs"]:
        if rule.get("action") == "keep":
            joined = ";".join(meta.get(label, "") for label in rule["source_labels"])
            assert re.fullmatch(rule["regex"], joined), f"{manifest}'s pods are dropped by {rule}"


PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(
    PROMTOOL is None and not os.environ.get("DTNODE_TEST_REQUIRE_PROMTOOL"),
    reason="promtool (Debian's prometheus package) is not installed; .ci/run installs it and requires it",
)
@pytest.mark.parametrize(
    "args",
    [
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "alerts.yml"],
        ["test", "rules", "alerts_test.yml"],
    ],
)
def test_promtool_checks_the_config_and_every_alert_fires_on_its_unit_series(args):
    assert PROMTOOL is not None, "DTNODE_TEST_REQUIRE_PROMTOOL is set and promtool is missing"
    result = subprocess.run(
        [PROMTOOL, *args], check=False, cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_unit_test():
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"][0]["rules"]
    tests = yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())["tests"]
    tested = {check["alertname"] for t in tests for check in t["alert_rule_test"] if check["exp_alerts"]}
    assert {r["alert"] for r in rules} <= tested
