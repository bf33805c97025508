"""deploy/: the Dockerfile, compose files and Kubernetes manifests agree with the code.

No container engine runs here, so these are structural checks: every YAML parses, the image's
and manifests' commands are console scripts of pyproject.toml, every flag they pass is one the
real CLIs accept (their ``--help``), every environment variable they set is one our code reads,
ports agree between Service, Deployment, probes and commands, and the scheduler configs parse
with the scheduler's own parser.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from opentinker_common.net.url import parse_scheduler_url
from opentinker_scheduler.config import load_config, parse_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCRIPTS = PYPROJECT["project"]["scripts"]
#: Variables our images set that third-party libraries read, not our code.
THIRD_PARTY_ENV = {
    "HF_HOME",
    "PYTHONUNBUFFERED",
    "PIP_NO_CACHE_DIR",
    "PIP_DISABLE_PIP_VERSION_CHECK",
    "AWS_ACCESS_KEY_ID",  # boto3: the scheduler's S3 artifact store
    "AWS_SECRET_ACCESS_KEY",
}
#: Where each role's environment variables are read.
ENV_SOURCES = {
    "opentinker-trainer": [ROOT / "opentinker_trainer" / "__main__.py", ROOT / "opentinker_common" / "logs.py"],
    "opentinker-scheduler": [ROOT / "opentinker_scheduler" / "__main__.py", ROOT / "opentinker_common" / "logs.py"],
}


def docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s(kind: str, name: str) -> dict:
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        for d in docs(path):
            if d.get("kind") == kind and d.get("metadata", {}).get("name") == name:
                return d
    raise AssertionError(f"no {kind} {name} in deploy/k8s")


@pytest.fixture(scope="module")
def cli_flags() -> dict[str, set[str]]:
    """Console script -> flags its real ``--help`` lists."""
    out = {}
    for script, target in SCRIPTS.items():
        module = target.split(":")[0].removesuffix(".__main__").removesuffix(".cli")
        proc = subprocess.run(
            [sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert proc.returncode == 0, proc.stderr
        out[script] = set(re.findall(r"--[a-z][a-z0-9-]*", proc.stdout))
    return out


def check_command(argv: list[str], cli_flags: dict[str, set[str]]) -> None:
    assert argv[0] in SCRIPTS, f"{argv[0]} is not a console script of pyproject.toml ({sorted(SCRIPTS)})"
    for arg in argv[1:]:
        if arg.startswith("--"):
            assert arg.split("=")[0] in cli_flags[argv[0]], f"{argv[0]} does not accept {arg}"


def check_env(script: str, names: list[str]) -> None:
    source = "\n".join(p.read_text() for p in ENV_SOURCES[script])
    for name in names:
        assert name in THIRD_PARTY_ENV or f'"{name}"' in source, f"{script} never reads environment variable {name}"


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


# ---------------------------------------------------------------------------------------------


def test_every_yaml_parses() -> None:
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 6
    for path in files:
        loaded = docs(path)
        assert loaded, path
        if path.parent.name == "k8s":
            for d in loaded:
                assert d["apiVersion"] and d["kind"], path
                assert d["kind"] == "Kustomization" or d["metadata"]["name"], path


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_entry_points_and_install(cli_flags) -> None:
    ins = dockerfile_instructions()
    assert ins[0] == ("FROM", "python:3.11-slim")
    cmds = [json.loads(rest) for word, rest in ins if word in ("CMD", "ENTRYPOINT")]
    assert cmds, "the image needs a CMD"
    for argv in cmds:
        check_command(argv, cli_flags)
    (extras,) = [rest.split("=", 1)[1] for word, rest in ins if word == "ARG" and rest.startswith("EXTRAS=")]
    for extra in extras.split(","):
        assert extra in PYPROJECT["project"]["optional-dependencies"], extra
    assert {"scheduler", "trainer"} <= set(extras.split(","))
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert "pip install -c constraints.txt" in runs  # the torch pin travels into the image
    for word, rest in ins:
        if word == "COPY":
            *sources, _dest = shlex.split(rest)
            for src in sources:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository (build context = repo root)"
    env_names = [m for word, rest in ins if word == "ENV" for m in re.findall(r"([A-Z_]+)=", rest)]
    check_env("opentinker-trainer", env_names)
    # the default CMD's config is the one the image copies, and it parses
    config_path = flag(cmds[-1], "--config")
    assert any(word == "COPY" and rest.endswith(config_path) for word, rest in ins)
    assert load_config(DEPLOY / "scheduler_config.yaml").allow_unknown_nodes


def test_the_image_runs_the_guides_commands_in_its_working_folder() -> None:
    """``docker run IMAGE python train_server.py`` (the guide's CMD) and ``python scheduler.py
    --config scheduler_config.yaml --port 8888``: both scripts and the config are in the final
    WORKDIR."""
    ins = dockerfile_instructions()
    workdir = [rest for word, rest in ins if word == "WORKDIR"][-1]
    copied = {
        f"{dest.rstrip('/')}/{Path(src).name}"
        for word, rest in ins
        if word == "COPY"
        for *sources, dest in [shlex.split(rest)]
        for src in sources
    }
    assert {f"{workdir}/scheduler.py", f"{workdir}/train_server.py"} <= copied
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert f"ln -s /etc/opentinker/scheduler_config.yaml {workdir}/scheduler_config.yaml" in runs
    # the scripts are the checkout's, importable without a checkout next to them (the image has none)
    for script in ("scheduler.py", "train_server.py"):
        assert "__main__ import main" in (ROOT / script).read_text()


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}`` with the variables unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(value))


def test_compose_runs_a_scheduler_and_n_trainers(cli_flags) -> None:
    compose = docs(DEPLOY / "compose.yaml")[0]
    services = compose["services"]
    sched, trainer = services["scheduler"], services["trainer"]
    check_command(sched["command"], cli_flags)
    check_command(trainer["command"], cli_flags)
    assert sched["command"][0] == "opentinker-scheduler" and trainer["command"][0] == "opentinker-trainer"
    assert (
        sched["build"]["dockerfile"] == "deploy/Dockerfile"
        and (DEPLOY / sched["build"]["context"] / sched["build"]["dockerfile"]).exists()
    )
    assert int(interpolate(trainer["deploy"]["replicas"])) >= 2

    grpc_port, http_port = flag(sched["command"], "--port"), flag(sched["command"], "--http-port")
    assert f"{grpc_port}:{grpc_port}" in sched["ports"] and f"{http_port}:{http_port}" in sched["ports"]
    assert f"127.0.0.1:{http_port}/health" in " ".join(sched["healthcheck"]["test"])

    env = trainer["environment"]
    check_env("opentinker-trainer", list(env))
    assert env["SCHEDULER_URL"] == f"http://scheduler:{grpc_port}"
    assert parse_scheduler_url(env["SCHEDULER_URL"]) == f"scheduler:{grpc_port}"
    assert f"127.0.0.1:{env['OPENTINKER_HTTP_PORT']}/health" in " ".join(trainer["healthcheck"]["test"])
    assert trainer["depends_on"]["scheduler"]["condition"] == "service_healthy"

    # volumes: named ones declared; the scheduler's state dir, nothing shared with the trainers
    declared = set(compose["volumes"])
    mounts = {s: {v.split(":")[0]: v.split(":")[1] for v in services[s]["volumes"]} for s in services}
    for svc, vols in mounts.items():
        for src in vols:
            assert src.startswith("./") or src in declared, f"{svc}: volume {src} is not declared"
    config_src = next(src for src, dst in mounts["scheduler"].items() if dst == flag(sched["command"], "--config"))
    config = load_config(DEPLOY / config_src)
    assert str(config.state_dir) == flag(sched["command"], "--state-dir") == mounts["scheduler"]["state"]
    # no shared checkpoint volume: checkpoints travel through the artifact store
    assert env["OPENTINKER_WORK_DIR"] not in mounts["scheduler"].values()
    assert env["OPENTINKER_WORK_DIR"] not in mounts["trainer"].values()

    gpu = docs(DEPLOY / "compose.gpu.yaml")[0]["services"]["trainer"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    check_env("opentinker-trainer", list(gpu.get("environment", {})))


def container(obj: dict) -> dict:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def test_k8s_scheduler_deployment_service_and_config(cli_flags) -> None:
    dep = k8s("Deployment", "opentinker-scheduler")
    svc = k8s("Service", "opentinker-scheduler")
    cm = k8s("ConfigMap", "opentinker-scheduler-config")
    c = container(dep)
    argv = c["command"] + c["args"]
    check_command(argv, cli_flags)
    check_env("opentinker-scheduler", [e["name"] for e in c.get("env", [])])

    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": int(flag(argv, "--port")), "http": int(flag(argv, "--http-port"))}
    svc_ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert svc_ports["grpc"]["port"] == 8888 and svc_ports["http"]["port"] == 8889
    for name, p in svc_ports.items():
        assert p["targetPort"] in (name, ports[name])
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(ports["http"])

    # the ConfigMap's config parses with the scheduler's parser and agrees with the mounts
    text = cm["data"]["scheduler_config.yaml"]
    config = parse_config(text, "configmap:scheduler_config.yaml")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert flag(argv, "--config") == f"{mounts['config']}/scheduler_config.yaml"
    assert str(config.state_dir) == flag(argv, "--state-dir") == mounts["state"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == cm["metadata"]["name"]
    for v in volumes.values():
        if "persistentVolumeClaim" in v:
            k8s("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
    # no volume is shared between processes: checkpoints travel through the artifact store
    for doc in docs(DEPLOY / "k8s" / "scheduler.yaml") + docs(DEPLOY / "k8s" / "trainer.yaml"):
        if doc and doc.get("kind") == "PersistentVolumeClaim":
            assert "ReadWriteMany" not in doc["spec"]["accessModes"], doc["metadata"]["name"]
    assert config.artifacts.backend == "local"
    # same keys as the compose/image config
    assert yaml.safe_load(text).keys() == yaml.safe_load((DEPLOY / "scheduler_config.yaml").read_text()).keys()


def test_k8s_trainer_daemonset(cli_flags) -> None:
    ds = k8s("DaemonSet", "opentinker-trainer")
    svc = k8s("Service", "opentinker-scheduler")
    c = container(ds)
    check_command(c["command"] + c.get("args", []), cli_flags)
    env = {e["name"]: e for e in c["env"]}
    check_env("opentinker-trainer", list(env))
    assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"]
    assert env["NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"

    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    url = env["SCHEDULER_URL"]["value"]
    assert parse_scheduler_url(url) == f"{svc['metadata']['name']}:{grpc_port}"

    http_port = int(env["OPENTINKER_HTTP_PORT"]["value"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": http_port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(http_port)
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["runs"] == env["OPENTINKER_WORK_DIR"]["value"]
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes["runs"]  # node-local; nothing shared with the scheduler or other nodes
    assert ds["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 60  # time to drain


def test_kustomization_lists_every_manifest() -> None:
    kust = docs(DEPLOY / "k8s" / "kustomization.yaml")[0]
    listed = set(kust["resources"])
    on_disk = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    assert k8s("Namespace", kust["namespace"])


def test_trainer_reads_its_port_and_scheduler_from_the_environment(tmp_path) -> None:
    """The variables the manifests set are really read: a bad value is refused by name."""
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("SCHEDULER_URL", "OPENTINKER_HTTP_PORT", "MAX_TASKS")}
    for var, bad in (("OPENTINKER_HTTP_PORT", "http"), ("SCHEDULER_URL", "ftp://x:1"), ("MAX_TASKS", "0")):
        proc = subprocess.run(
            [sys.executable, "-m", "opentinker_trainer", "--work-dir", str(tmp_path)],
            env={**base, var: bad},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert proc.returncode == 2 and f"environment variable {var}" in proc.stderr, proc.stderr


# ------------------------------------------------------------------ several schedulers (PostgreSQL)


def _haproxy(path: Path) -> dict[str, list[str]]:
    """Section header -> its lines, of an haproxy.cfg."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not raw.startswith((" ", "\t")):
            current = line.strip()
            sections[current] = []
        elif current is not None:
            sections[current].append(line.strip())
    return sections


def haproxy_default(word: str) -> str:
    """The value of an haproxy.cfg word with its environment variables unset: ``"${X-d}"`` is d."""
    return re.sub(r"\$\{[A-Z_]+-([^}]*)\}", r"\1", word.strip('"'))


def frontend_bind(cfg: dict[str, list[str]]) -> str:
    (frontend,) = [k for k in cfg if k.startswith("frontend")]
    return next(line.split()[1] for line in cfg[frontend] if line.startswith("bind"))


def test_haproxy_cfg_runs_on_bare_hosts_its_addresses_from_documented_variables() -> None:
    """No Docker-only resolver: names resolve at start through the system (init-addr libc), later
    through /etc/resolv.conf's nameservers; every variable it reads is named in its header and in
    the bare-metal guide, with the default the file carries."""
    text = (DEPLOY / "haproxy.cfg").read_text()
    cfg = _haproxy(DEPLOY / "haproxy.cfg")
    assert "127.0.0.11" not in text and "resolvers docker" not in text
    (resolvers,) = [k for k in cfg if k.startswith("resolvers ")]
    assert "parse-resolv-conf" in cfg[resolvers]
    default = next(line for line in cfg["backend schedulers"] if line.startswith("default-server"))
    assert f"resolvers {resolvers.split()[1]}" in default
    assert "init-addr last,libc,none" in default
    header = text.split("\nglobal", 1)[0]
    guide = (ROOT / "docs" / "cluster.md").read_text()
    variables = re.findall(r"\$\{([A-Z_]+)-([^}]*)\}", text)
    assert {v for v, _ in variables} == {"OPENTINKER_LB_BIND", "OPENTINKER_SCHEDULER_A", "OPENTINKER_SCHEDULER_B"}
    for var, value in variables:
        assert re.search(rf"{var}\s+.*default {re.escape(value)}", header), var
        assert var in guide, var


def test_compose_ha_runs_postgres_two_schedulers_a_balancer_and_trainers(cli_flags) -> None:
    compose = docs(DEPLOY / "compose.ha.yaml")[0]
    services = compose["services"]
    schedulers = {name: s for name, s in services.items() if name.startswith("scheduler-")}
    assert len(schedulers) == 2 and {"postgres", "lb", "trainer"} <= set(services)
    pg_env = services["postgres"]["environment"]
    for name, s in schedulers.items():
        argv = s["command"]
        check_command(argv, cli_flags)
        check_env("opentinker-scheduler", [k for k in s["environment"] if k != "OPENTINKER_DB_PASSWORD"])
        assert flag(argv, "--advertise-address") == f"{name}:{flag(argv, '--port')}"
        mounts = {v.split(":")[1]: v.split(":")[0] for v in s["volumes"]}
        config = load_config(DEPLOY / mounts[flag(argv, "--config")])
        assert config.store.kind == "postgres" and config.store.password_env in s["environment"]
        assert config.artifacts.backend == "s3"  # checkpoints where every scheduler finds them
        assert config.artifacts.s3.endpoint.split("//")[1].split(":")[0] in services
        assert interpolate(s["environment"][config.store.password_env]) == interpolate(pg_env["POSTGRES_PASSWORD"])
        dsn = dict(part.split("=", 1) for part in config.store.dsn.split())
        assert (
            dsn["host"] == "postgres"
            and dsn["dbname"] == pg_env["POSTGRES_DB"]
            and dsn["user"] == pg_env["POSTGRES_USER"]
        )
        assert str(config.state_dir) == flag(argv, "--state-dir")
        assert f"127.0.0.1:{flag(argv, '--http-port')}/health" in " ".join(s["healthcheck"]["test"])
        assert s["depends_on"]["postgres"]["condition"] == "service_healthy"
    # HAProxy: TCP, to the one scheduler that passes /ready on its HTTP port
    lb = services["lb"]
    cfg_src = next(v.split(":")[0] for v in lb["volumes"] if v.split(":")[1].endswith("haproxy.cfg"))
    cfg = _haproxy(DEPLOY / cfg_src)
    assert "mode tcp" in cfg["defaults"]
    (frontend,) = [k for k in cfg if k.startswith("frontend")]
    bind_port = haproxy_default(frontend_bind(cfg)).split(":")[-1]
    assert f"{bind_port}:{bind_port}" in lb["ports"]
    backend = cfg["backend schedulers"]
    assert "option httpchk GET /ready" in backend and "http-check expect status 200" in backend
    default = next(line for line in backend if line.startswith("default-server"))
    servers = {line.split()[1]: haproxy_default(line.split()[2]) for line in backend if line.startswith("server ")}
    assert set(servers) == set(schedulers)
    for name, s in schedulers.items():
        assert servers[name] == f"{name}:{flag(s['command'], '--port')}"
        assert f"check port {flag(s['command'], '--http-port')}" in default
    assert haproxy_default(frontend_bind(cfg)) == f":{bind_port}"
    assert "on-marked-down shutdown-sessions" in default
    env = services["trainer"]["environment"]
    check_env("opentinker-trainer", list(env))
    assert not [k for k in env if k.startswith("AWS_")]  # the scheduler presigns the trainers' transfers
    assert parse_scheduler_url(env["SCHEDULER_URL"]) == f"lb:{bind_port}"
    declared = set(compose["volumes"])
    for name, svc in services.items():
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            assert src.startswith("./") or src in declared, f"{name}: volume {src} is not declared"


def _k8s_ha(kind: str, name: str) -> dict:
    for path in (DEPLOY / "k8s-ha").glob("*.yaml"):
        for d in docs(path):
            if d.get("kind") == kind and d.get("metadata", {}).get("name") == name:
                return d
    raise AssertionError(f"no {kind} {name} in deploy/k8s-ha")


def test_k8s_ha_two_replicas_ready_only_on_the_leader(cli_flags) -> None:
    dep = _k8s_ha("Deployment", "opentinker-scheduler")
    svc = _k8s_ha("Service", "opentinker-scheduler")
    cm = _k8s_ha("ConfigMap", "opentinker-scheduler-config")
    assert dep["spec"]["replicas"] == 2
    c = container(dep)
    argv = c["command"] + c["args"]
    check_command(argv, cli_flags)
    env = {e["name"]: e for e in c["env"]}
    check_env("opentinker-scheduler", [n for n in env if n not in ("POD_IP", "OPENTINKER_DB_PASSWORD")])
    names = [e["name"] for e in c["env"]]
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["OPENTINKER_ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{flag(argv, '--port')}"
    assert names.index("POD_IP") < names.index("OPENTINKER_ADVERTISE_ADDRESS")  # defined first: $(POD_IP) expands
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 2  # a follower is never Ready
    config = parse_config(cm["data"]["scheduler_config.yaml"], "configmap:scheduler_config.yaml")
    assert config.store.kind == "postgres" and config.artifacts.backend == "s3"
    secret_ref = env[config.store.password_env]["valueFrom"]["secretKeyRef"]
    secret = _k8s_ha("Secret", secret_ref["name"])
    assert secret_ref["key"] in secret["stringData"]
    pg_svc = dict(part.split("=", 1) for part in config.store.dsn.split())["host"]
    pg = _k8s_ha("Service", pg_svc)
    sts = _k8s_ha("StatefulSet", pg_svc)
    assert pg["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    # the artifacts' S3 store is a Service here, its keys one Secret given to the schedulers and the store;
    # trainers hold none (the scheduler presigns their transfers)
    endpoint = config.artifacts.s3.endpoint.split("//")[1]
    s3_svc = _k8s_ha("Service", endpoint.split(":")[0])
    assert int(endpoint.split(":")[1]) in [p["port"] for p in s3_svc["spec"]["ports"]]
    s3 = _k8s_ha("StatefulSet", s3_svc["metadata"]["name"])
    assert s3_svc["spec"]["selector"].items() <= s3["spec"]["template"]["metadata"]["labels"].items()
    trainer = {e["name"]: e for e in container(_k8s_ha("DaemonSet", "opentinker-trainer"))["env"]}
    assert not [name for name in trainer if name.startswith("AWS_")], trainer
    refs = [
        {k: v for k, v in env[name]["valueFrom"]["secretKeyRef"].items() if k != "optional"}
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    ]
    store_env = [e["valueFrom"]["secretKeyRef"] for e in container(s3)["env"] if "valueFrom" in e]
    assert sorted(map(str, store_env)) == sorted(map(str, refs))
    for ref in refs:
        assert ref["key"] in _k8s_ha("Secret", ref["name"])["stringData"]
    # the trainers and the namespace are those of the one-scheduler manifests
    for same in ("trainer.yaml", "namespace.yaml"):
        assert (DEPLOY / "k8s-ha" / same).read_text() == (DEPLOY / "k8s" / same).read_text(), same
    kust = docs(DEPLOY / "k8s-ha" / "kustomization.yaml")[0]
    assert set(kust["resources"]) == {p.name for p in (DEPLOY / "k8s-ha").glob("*.yaml")} - {"kustomization.yaml"}
    # the ConfigMap and the compose config hold the same keys
    ha_compose = yaml.safe_load((DEPLOY / "scheduler_config.ha.yaml").read_text())
    assert yaml.safe_load(cm["data"]["scheduler_config.yaml"]).keys() == ha_compose.keys()
