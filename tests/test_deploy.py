"""The deployment files, checked without Docker (Docker cannot run on this machine): the
compose file parses, each service's command resolves to something the image really has (a
console script of [project.scripts] and its subcommand, alembic with its ini and migrations,
a Celery app), and the environment it sets is what the settings read. And its defaults are
safe: the secrets are required and have no defaults, Redis asks for its password (the one in
every broker URL), the published ports listen on 127.0.0.1 unless the user opts in, and no
container runs as root or keeps a capability."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import redis
import tomllib
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from specq.api import cli
from specq.configs.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "docker-compose.yml").read_text()
COMPOSE = yaml.safe_load(TEXT)
SERVICES = COMPOSE["services"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DOCKERFILE = (ROOT / "Dockerfile").read_text()
DEPLOYMENT = (ROOT / "docs" / "operations.md").read_text()  # its Deployment section
OURS = [name for name, s in SERVICES.items() if s.get("image") == "specq:latest"]
# What a user puts in .env (hex, as docs/operations.md says), and what compose must demand.
SECRETS = {"REDIS_PASSWORD": "5f0c1d2e3a4b", "POSTGRES_PASSWORD": "9a8b7c6d5e4f",
           "FLOWER_BASIC_AUTH": "admin:0123abcd", "READONLY_PASSWORD": "3c4d5e6f7a8b",
           "GRAFANA_PASSWORD": "7e8f9a0b1c2d"}
NOT_ROOT = ("root", "0")

_REFERENCE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?)([-?])([^}]*))?\}|(\w+))")


class Unset(Exception):
    """A required variable (${VAR:?error}) is not set: compose refuses to start."""


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's interpolation: $$ (a literal $), $VAR, ${VAR}, ${VAR:-default},
    ${VAR-default}, ${VAR:?error}, ${VAR?error}. With env None nothing is set, and required
    variables read 'x' (as if the user had set them); else the variables are env's."""

    def one(m: re.Match) -> str:
        dollar, name, colon, op, arg, bare = m.groups()
        if dollar:
            return "$"
        if env is None:
            return arg if op == "-" else "x"
        value = env.get(name or bare)
        if value is not None and (value or not colon):
            return value
        if op == "-":
            return arg
        if op == "?":
            raise Unset(f"{name}: {arg}")
        return ""

    return _REFERENCE.sub(one, value)


def strings(node):
    """Every string in a piece of the compose file (keys of mappings included)."""
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from strings(key)
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)


def container_env(name: str, env: dict[str, str]) -> dict[str, str]:
    """A service's environment inside its container, with env as compose's variables."""
    return {k: interpolate(str(v), env) for k, v in SERVICES[name].get("environment", {}).items()}


def shell_expand(script: str, env: dict[str, str]) -> str:
    """$VAR and ${VAR} of a shell script (after compose), from the container's environment."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), script)


def bindings(service: dict):
    """(host address as written, host port, container port) of each published port."""
    for port in service.get("ports", []):
        if isinstance(port, dict):
            yield str(port.get("host_ip", "")), str(port.get("published")), str(port["target"])
        else:
            parts = str(port).rsplit(":", 2)  # [address:][host port:]container port
            yield tuple([""] * (3 - len(parts)) + parts)


def test_services_and_persistence():
    assert {"redis", "postgres", "migrate", "worker-gpu0", "beat", "flower", "api"} <= set(
        SERVICES)
    redis_cmd = " ".join(SERVICES["redis"]["command"])
    assert "--appendonly yes" in redis_cmd and "--maxmemory-policy noeviction" in redis_cmd
    volumes = set(COMPOSE["volumes"])
    assert SERVICES["postgres"]["volumes"][0].split(":")[0] in volumes
    assert SERVICES["redis"]["volumes"][0].split(":")[0] in volumes
    assert SERVICES["migrate"]["restart"] == "no"
    beats = [n for n in OURS if SERVICES[n]["command"][:2] == ["specq", "beat"]]
    assert beats == ["beat"] and "replicas" not in SERVICES["beat"].get("deploy", {})
    assert "FLOWER_BASIC_AUTH" in SERVICES["flower"]["environment"]
    assert ":?" in SERVICES["flower"]["environment"]["FLOWER_BASIC_AUTH"]  # required, no default


def test_readonly_role_is_made_after_every_migration():
    """The one-shot `readonly` runs db/readonly.sql with psql (tests/db/test_readonly.py runs
    this very command on PostgreSQL) as the owner of the tables, once migrate is done."""
    service = SERVICES["readonly"]
    assert service["image"] == SERVICES["postgres"]["image"]  # its psql
    assert service["restart"] == "no"
    assert service["depends_on"] == {"migrate": {"condition": "service_completed_successfully"}}
    (mount,) = service["configs"]
    assert (ROOT / COMPOSE["configs"][mount["source"]]["file"]).resolve() == (
        ROOT / "db" / "readonly.sql")
    command = service["command"]
    assert command[0] == "psql" and command[command.index("-f") + 1] == mount["target"]
    assert "ON_ERROR_STOP=1" in command
    env, server = container_env("readonly", SECRETS), container_env("postgres", SECRETS)
    assert env["PGHOST"] == "postgres"
    assert (env["PGUSER"], env["PGDATABASE"], env["PGPASSWORD"]) == (
        server["POSTGRES_USER"], server["POSTGRES_DB"], server["POSTGRES_PASSWORD"])
    migrate_url = urlsplit(container_env("migrate", SECRETS)["SPECQ_DATABASE_URL"])
    assert migrate_url.username == env["PGUSER"]  # it owns what the migrations create
    assert env["READONLY_PASSWORD"] == SECRETS["READONLY_PASSWORD"]
    assert service["environment"]["READONLY_PASSWORD"].startswith("${READONLY_PASSWORD:?")


def test_one_worker_per_gpu_and_a_cpu_one_each_under_a_profile():
    """GPU workers reserve one device each under the profiles gpu/gpu1, a CPU worker
    reserves none under the profile cpu: a plain `docker compose up -d` starts no worker
    and asks for no GPU."""
    workers = [n for n in OURS if SERVICES[n]["command"][:2] == ["specq", "worker"]]
    gpu = [n for n in workers if "deploy" in SERVICES[n]]
    devices = []
    for name in gpu:
        (reservation,) = SERVICES[name]["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia" and reservation["capabilities"] == ["gpu"]
        devices += reservation["device_ids"]
        assert {"gpu", "gpu1"} & set(SERVICES[name]["profiles"]), name
    assert len(devices) == len(set(devices)) == len(gpu) >= 2
    assert "gpu" in SERVICES["worker-gpu0"]["profiles"]
    assert [n for n in workers if n not in gpu] == ["worker-cpu"]
    cpu = SERVICES["worker-cpu"]
    assert cpu["profiles"] == ["cpu"] and cpu["environment"]["SPECQ_DEVICE"] == "cpu"
    for name in workers:
        assert SERVICES[name].get("profiles"), f"{name} starts without a profile"
        assert "${SPECQ_" in " ".join(SERVICES[name]["command"])  # pair from the env
        env = SERVICES[name]["environment"]
        # a gated model's token, optional, and a model cache on its own volume
        assert env["HF_TOKEN"] == "${HF_TOKEN:-}"
        assert any(v.endswith(f":{env['HF_HOME']}") and v.split(":")[0] in COMPOSE["volumes"]
                   for v in SERVICES[name]["volumes"])
    assert "/app/models" in DOCKERFILE  # owned by the image's user, as the volume copies it


@pytest.mark.parametrize("name", OURS)
def test_command_resolves_in_the_image(name):
    cmd = [interpolate(c) for c in SERVICES[name]["command"]]
    if cmd[0] == "specq":
        # the command starts in api/command.py, which hands every subcommand but a plain
        # status to cli.py
        assert PYPROJECT["project"]["scripts"]["specq"] == "specq.api.command:main"
        args = cli.parser().parse_args(cmd[1:])  # the subcommand and its flags exist
        assert callable(args.func)
    elif cmd[0] == "alembic":
        assert cmd[1:] == ["upgrade", "head"]
        assert "COPY pyproject.toml README.md alembic.ini ./" in DOCKERFILE
        assert "alembic" in " ".join(PYPROJECT["project"]["dependencies"])
    elif cmd[0] == "celery":
        module = cmd[cmd.index("-A") + 1]
        assert hasattr(importlib.import_module(module), "app")
        if "flower" in cmd:
            assert any(d.startswith("flower") for d in
                       PYPROJECT["project"]["optional-dependencies"]["flower"])
            assert 'pip install ".[worker,flower,serve]"' in DOCKERFILE
    else:
        pytest.fail(f"{name}: unknown command {cmd}")


def test_alembic_upgrade_head_runs_as_the_migrate_service_does(tmp_path):
    """`alembic upgrade head` from the image's working directory (the repo root)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}
    env["SPECQ_DATABASE_URL"] = f"sqlite:///{tmp_path / 'specq.db'}"
    alembic = Path(sys.executable).with_name("alembic")
    done = subprocess.run([str(alembic), "upgrade", "head"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "specq.db").exists()


def test_environment_is_what_settings_read():
    known = {f"SPECQ_{f.upper()}" for f in Settings.model_fields}
    for name in OURS:
        env = SERVICES[name]["environment"]
        ours = {k for k in env if k.startswith("SPECQ_")}
        assert ours <= known, f"{name}: {ours - known} are read by nothing"
        assert {"SPECQ_BROKER_URL", "SPECQ_DATABASE_URL"} <= ours
        settings = Settings(**{k.removeprefix("SPECQ_").lower(): interpolate(v)
                               for k, v in env.items() if k in ours})
        assert settings.broker_url == "redis://:x@redis:6379/0"  # x: the password
        assert settings.sqlalchemy_url == "postgresql+psycopg://specq:x@postgres:5432/specq"


def test_dockerfile_builds_what_the_package_needs():
    assert re.search(r"^ARG TORCH=cpu$", DOCKERFILE, re.M)
    assert "download.pytorch.org/whl/${TORCH}" in DOCKERFILE
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"": "src"}  # one name: specq
    rooms = {p.name for p in (ROOT / "src" / "specq").iterdir() if p.is_symlink()}
    assert rooms == {"api", "broker", "worker", "db", "configs", "schema", "bench"}
    for folder in (*rooms, "src"):  # each room src/specq links to is in the image
        assert f"COPY {folder} {folder}" in DOCKERFILE
    assert (ROOT / "alembic.ini").read_text().count("script_location = %(here)s/db/migrations")


# Secure defaults.


def test_published_ports_listen_on_loopback_unless_the_user_opts_in():
    published = {name: list(bindings(s)) for name, s in SERVICES.items() if s.get("ports")}
    assert set(published) == {"redis", "postgres", "flower", "api", "prometheus", "grafana"}
    for name, ports in published.items():
        for address, host_port, container_port in ports:
            where = f"{name}: {address}:{host_port}:{container_port}"
            assert interpolate(address, {}) == "127.0.0.1", f"{where} listens on every interface"
            # The opt-in: a variable with loopback as its default, e.g. SPECQ_BIND=10.0.0.5.
            opt_in = re.fullmatch(r"\$\{(\w+):-127\.0\.0\.1\}", address)
            assert opt_in, f"{where}: the address should be ${{VAR:-127.0.0.1}}"
            assert interpolate(address, {opt_in.group(1): "10.0.0.5"}) == "10.0.0.5"
            assert host_port == container_port
    for name, service in SERVICES.items():
        assert service.get("network_mode") != "host", f"{name} bypasses the port bindings"


WITHOUT_REFERENCES = _REFERENCE.sub(lambda m: m.group(0) if m.group(1) else "${}", TEXT)


def test_secrets_are_required_and_have_no_defaults():
    required = {m.group(2) for m in _REFERENCE.finditer(TEXT) if m.group(4) == "?"}
    assert required == set(SECRETS)
    for secret in SECRETS:  # every use is ${SECRET:?...}: no default, empty refused
        uses = re.findall(rf"\$\{{{secret}([^}}]*)\}}", TEXT)
        assert uses and all(u.startswith(":?") for u in uses), f"{secret}: {uses}"
        # Nor a literal anywhere, comments included (formerly POSTGRES_PASSWORD=change-me).
        for value in re.findall(rf"\b{secret}\b\s*[=:]\s*(\S+)", WITHOUT_REFERENCES):
            assert value.lstrip("\"'").startswith(("${", "$$", "$(")), f"{secret}={value}"
    # Compose refuses to start when one is missing: some string of the services needs it.
    for secret in SECRETS:
        env = {k: v for k, v in SECRETS.items() if k != secret}
        with pytest.raises(Unset, match=secret):
            for text in strings(SERVICES):
                interpolate(text, env)
    postgres = SERVICES["postgres"]["environment"]
    assert postgres["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    assert "POSTGRES_HOST_AUTH_METHOD" not in postgres  # no trust
    assert "trust" not in postgres.get("POSTGRES_INITDB_ARGS", "")


def test_redis_asks_for_the_password_of_every_broker_url():
    server = container_env("redis", SECRETS)
    command = shell_expand(" ".join(interpolate(c, SECRETS) for c in SERVICES["redis"]["command"]),
                           server)
    password = SECRETS["REDIS_PASSWORD"]
    assert re.search(rf"--requirepass \"?{password}\"?( |$)", command), command
    # The file names the variable, never a value: in the command, or in the environment the
    # command's shell reads.
    raw = " ".join(SERVICES["redis"]["command"])
    via_env = re.search(r"--requirepass \"?\$\$\{?(\w+)", raw)
    if via_env:
        assert SERVICES["redis"]["environment"][via_env.group(1)].startswith("${REDIS_PASSWORD:?")
    else:
        assert "${REDIS_PASSWORD:?" in raw
    for name in OURS:
        url = urlsplit(container_env(name, SECRETS)["SPECQ_BROKER_URL"])
        assert (url.scheme, url.hostname, url.port, url.path) == ("redis", "redis", 6379, "/0")
        assert unquote(url.password or "") == password, f"{name}: the broker URL's password"


def test_postgres_password_is_the_one_every_database_url_uses():
    server = container_env("postgres", SECRETS)
    for name in OURS:
        url = urlsplit(container_env(name, SECRETS)["SPECQ_DATABASE_URL"])
        assert (url.hostname, url.port, url.path) == ("postgres", 5432, "/specq")
        assert url.username == server["POSTGRES_USER"]
        assert unquote(url.password or "") == server["POSTGRES_PASSWORD"]
    # A new database asks for the password on TCP, loopback included (initdb trusts it).
    assert "--auth-host=scram-sha-256" in server["POSTGRES_INITDB_ARGS"]


def test_healthchecks_authenticate():
    kind, check = SERVICES["redis"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and "redis-cli" in check
    assert re.search(r"REDISCLI_AUTH=\"?\$\$\{?REDIS_PASSWORD|-a \"?\$\$\{?REDIS_PASSWORD", check)
    assert "PONG" in check  # redis-cli may exit 0 on an error reply (NOAUTH, WRONGPASS)
    kind, check = SERVICES["postgres"]["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and "psql" in check  # pg_isready never authenticates
    assert re.search(r"PGPASSWORD=\"?\$\$\{?POSTGRES_PASSWORD", check)
    assert "-h 127.0.0.1" in check  # TCP: the password is asked; not the socket (trusted)
    for name in ("redis", "postgres"):  # what a shell in the container reads, it has
        service = SERVICES[name]
        script = " ".join(service["healthcheck"]["test"] + service.get("command", []))
        for var in re.findall(r"\$\$\{?(\w+)", script):
            assert var in service["environment"], f"{name}: ${var} is not set in the container"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not (shutil.which("redis-server") and shutil.which("redis-cli")),
                    reason="needs redis-server and redis-cli")
def test_redis_as_composed_refuses_strangers_and_its_healthcheck_tells(tmp_path):
    """The compose command of Redis, run as its container would (on a free port here): the
    broker URLs get in, no password or a wrong one does not, the healthcheck says which."""
    port = _free_port()
    server_env = container_env("redis", SECRETS)
    command = [interpolate(c, SECRETS) for c in SERVICES["redis"]["command"]]
    local = f" --port {port} --bind 127.0.0.1 --dir {tmp_path} --save ''"
    if command[:2] == ["sh", "-c"]:
        command[-1] += local
    else:
        command += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)]
    # The healthcheck's redis-cli, pointed at that port.
    shims = tmp_path / "bin"
    shims.mkdir()
    real = shutil.which("redis-cli")
    (shims / "redis-cli").write_text(f'#!/bin/sh\nexec {real} -p {port} "$@"\n')
    (shims / "redis-cli").chmod(0o755)
    path = f"{shims}{os.pathsep}{os.environ['PATH']}"
    server = subprocess.Popen(command, env={"PATH": os.environ["PATH"], **server_env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, password=SECRETS["REDIS_PASSWORD"],
                             decode_responses=True)
        deadline = time.monotonic() + 30  # a busy machine starts it later
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start in 30 s"
                time.sleep(0.05)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        for name in OURS:
            url = container_env(name, SECRETS)["SPECQ_BROKER_URL"]
            assert "@redis:6379/" in url, f"{name}: {url}"
            url = url.replace("@redis:6379/", f"@127.0.0.1:{port}/")
            assert redis.Redis.from_url(url).ping(), name
        once = Retry(NoBackoff(), 0)  # an authentication error, at once
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, retry=once).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="wrong", retry=once).ping()

        _, check = SERVICES["redis"]["healthcheck"]["test"]
        check = interpolate(check, SECRETS)

        def healthy(password: str) -> bool:
            env = {"PATH": path, **server_env, "REDIS_PASSWORD": password}
            return subprocess.run(["sh", "-c", check], env=env, capture_output=True,
                                  timeout=30).returncode == 0

        assert healthy(SECRETS["REDIS_PASSWORD"])
        assert not healthy("wrong") and not healthy("")
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_containers_run_unprivileged():
    # The image: a USER that is not root, set after the installs, before the CMD.
    lines = DOCKERFILE.replace("\\\n", " ").splitlines()
    users = [i for i, line in enumerate(lines) if line.startswith("USER ")]
    assert users, "the image runs as root"
    last = users[-1]
    user, _, group = lines[last].split()[1].partition(":")
    assert user not in NOT_ROOT and group not in NOT_ROOT
    installs = [i for i, line in enumerate(lines) if line.startswith("RUN ")]
    assert last > installs[-1] and last < next(i for i, ln in enumerate(lines)
                                               if ln.startswith("CMD "))
    created = next(line for line in lines if "useradd" in line)
    name = re.search(r"useradd\b.*?\b(\w+)\s*(?:&&|$)", created).group(1)
    uid = re.search(r"--uid (\d+)", created).group(1)
    assert user in (name, uid) and int(uid) != 0
    # It owns the data directory the services write (SPECQ_DATA_DIR).
    data_dir = {SERVICES[n]["environment"]["SPECQ_DATA_DIR"] for n in OURS}
    assert data_dir == {"/app/data"}
    # ... and a container run without compose (a worker on another host) uses it too, not
    # the user's own data directory outside the mounted volume
    assert re.search(r"^ENV SPECQ_DATA_DIR=/app/data$", DOCKERFILE, re.M)
    assert re.search(rf"(install -d|chown)\b.*\b(-o )?({name}|{uid})\b.*\s/app/data\b",
                     " ".join(lines))
    for where, service in SERVICES.items():
        # Ours keep the image's user; Redis and PostgreSQL start as their images' users (as
        # root, their entrypoints would need the capabilities dropped below to step down).
        user = str(service.get("user", "")).split(":")[0]
        if where in OURS:
            assert user not in NOT_ROOT, f"{where} runs as root"
        else:
            assert user and user not in NOT_ROOT, f"{where} starts as root"
        assert "no-new-privileges:true" in service.get("security_opt", []), where
        assert service.get("cap_drop") == ["ALL"] and not service.get("cap_add"), where
        assert not service.get("privileged"), where


def test_data_volumes_are_named_volumes():
    """A user: (or the image's USER) writes its volume only if the volume belongs to it: a
    new named volume copies the ownership of the image's directory; a host directory that
    Docker creates belongs to root."""
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = interpolate(volume, {}).split(":")[0]
            assert source in COMPOSE["volumes"], f"{name}: {volume} is not a named volume"


def test_the_deployment_docs_name_every_compose_variable():
    names = {m.group(2) or m.group(6) for m in _REFERENCE.finditer(TEXT) if not m.group(1)}
    assert {"SPECQ_BIND", "FLOWER_BIND", *SECRETS} <= names
    section = DEPLOYMENT.split("\n## Deployment\n", 1)[1].split("\n## ", 1)[0]
    for name in names:
        assert name in section, f"docs/operations.md, Deployment: nothing on {name}"
