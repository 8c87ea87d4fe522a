"""The Helm chart in helm/specserve.

Static checks always run: Chart.yaml and values.yaml parse and hold the documented keys, every
`.Values` path a template reads exists in values.yaml, and every template's actions are balanced.
`helm lint` and `helm template` run too, and the rendered manifests are checked: with a `helm`
binary on PATH, else through the Helm SDK for Python (`helm-python-sdk`, Helm's own Go code
built as a library, no binary and no cluster), which a test install brings.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")

CHART = Path(__file__).resolve().parents[2] / "helm" / "specserve"
TEMPLATES = CHART / "templates"
TEMPLATE_FILES = sorted(p for p in TEMPLATES.iterdir() if p.is_file())
HELM = shutil.which("helm")
try:
    import helm_python
except ImportError:  # pragma: no cover - the test extra installs it
    helm_python = None
RELEASE = "demo"
# <release>-<chart>: the names _helpers.tpl gives the release's resources.
FULLNAME = f"{RELEASE}-specserve"

needs_helm = pytest.mark.skipif(
    HELM is None and helm_python is None, reason="neither a helm binary nor helm-python-sdk"
)


def _load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((CHART / name).read_text())
    assert isinstance(data, dict), f"{name} is not a mapping"
    return data


def _lookup(tree: Any, path: list[str]) -> Any:
    for key in path:
        assert isinstance(tree, dict) and key in tree, f"missing key {'.'.join(path)}"
        tree = tree[key]
    return tree


# --- Chart.yaml and values.yaml -------------------------------------------------------------


def test_chart_yaml() -> None:
    chart = _load("Chart.yaml")
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "specserve"
    assert chart["version"] == "0.1.0"
    assert str(chart["appVersion"]) == "0.1.0"
    assert chart.get("type", "application") == "application"
    assert chart.get("description")


def test_template_files_present() -> None:
    names = {p.name for p in TEMPLATE_FILES}
    assert {
        "_helpers.tpl",
        "control-deployment.yaml",
        "control-service.yaml",
        "worker-deployment.yaml",
        "redis.yaml",
        "api-deployment.yaml",
        "api-service.yaml",
        "NOTES.txt",
    } <= names


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("image.repository", "specserve"),
        ("image.tag", ""),  # the chart's appVersion
        ("image.pullPolicy", "IfNotPresent"),
        ("model.name", "smollm2-135m"),
        ("model.path", ""),
        ("model.pvc", ""),
        ("control.port", 5555),
        ("api.enabled", True),
        ("api.port", 8000),
        ("api.apiKeySecret", ""),
        ("control.metricsPort", 9090),
        ("control.routing", "prefix"),
        ("control.heartbeatTimeout", 3.0),
        ("control.logJson", False),
        ("control.service.type", "ClusterIP"),
        ("control.podAnnotations", ...),
        ("control.resources", ...),
        ("worker.replicas", 2),
        ("worker.device", "cpu"),
        ("worker.dtype", ...),
        ("worker.attentionBackend", "auto"),
        ("worker.spec.method", "none"),
        ("worker.spec.numSpecTokens", ...),
        ("worker.spec.drafter.path", ""),
        ("worker.spec.drafter.pvc", ""),
        ("worker.kvCacheMemoryMb", ...),
        ("worker.maxNumSeqs", ...),
        ("worker.logJson", False),
        ("worker.terminationGracePeriodSeconds", ...),
        ("worker.resources", ...),
        ("worker.nodeSelector", {}),
        ("worker.tolerations", []),
        ("redis.enabled", True),
        ("redis.url", ""),
        ("redis.image.repository", "redis"),
        ("redis.image.tag", "7-alpine"),
        ("redis.resources", ...),
    ],
)
def test_values_keys(path: str, expected: Any) -> None:
    value = _lookup(_load("values.yaml"), path.split("."))
    if expected is not ...:
        assert value == expected


@needs_helm
def test_prometheus_annotations_follow_the_metrics_port() -> None:
    for port in ("9090", "9191"):
        objs = _render("--set", f"control.metricsPort={port},control.podAnnotations.team=ml")
        meta = objs[("Deployment", f"{FULLNAME}-control")]["spec"]["template"]["metadata"]
        assert meta["annotations"] == {
            "prometheus.io/scrape": "true", "prometheus.io/port": port,
            "prometheus.io/path": "/metrics", "team": "ml",
        }  # fmt: skip
    objs = _render("--set", "control.prometheusAnnotations=false")
    meta = objs[("Deployment", f"{FULLNAME}-control")]["spec"]["template"]["metadata"]
    assert "annotations" not in meta


@needs_helm
def test_extra_args_env_and_disruption_budgets() -> None:
    objs = _render(
        # (--set-string: a flag's value must be a string; the schema refuses a number there)
        "--set-string", "worker.extraArgs={--max-model-len,8192}",
        "--set-string", "api.extraArgs={--request-timeout,300}",
        "--set-string", "control.extraArgs={--max-pending-per-client,4096}",
        "--set", "worker.env[0].name=HF_HOME,worker.env[0].value=/tmp/hf",
    )  # fmt: skip
    for name, flag, value in (
        ("worker", "--max-model-len", "8192"),
        ("api", "--request-timeout", "300"),
        ("control", "--max-pending-per-client", "4096"),
    ):
        assert _flag(_container(objs[("Deployment", f"{FULLNAME}-{name}")])["args"], flag) == value
    env = _container(objs[("Deployment", f"{FULLNAME}-worker")])["env"]
    assert {"name": "HF_HOME", "value": "/tmp/hf"} in env
    for name in ("worker", "api"):
        pdb = objs[("PodDisruptionBudget", f"{FULLNAME}-{name}")]
        deployment = objs[("Deployment", f"{FULLNAME}-{name}")]
        assert pdb["spec"]["maxUnavailable"] == 1
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    none = _render("--set", "worker.maxUnavailable=0,api.enabled=false")
    assert not [key for key in none if key[0] == "PodDisruptionBudget"]


def test_values_document_a_gpu_request() -> None:
    text = (CHART / "values.yaml").read_text()
    assert re.search(r"^\s*#\s*nvidia\.com/gpu:\s*1\s*$", text, re.M), "GPU example missing"
    assert "nvidia.com/gpu" not in _load("values.yaml")["worker"]["resources"].get("limits", {})


def test_values_top_level_keys_are_commented() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z]\w*:", line):
            assert i > 0 and lines[i - 1].lstrip().startswith("#"), f"undocumented: {line}"


# --- templates, statically ------------------------------------------------------------------

_VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z_]\w*)+)")
_VAR_BINDING = re.compile(r"(\$[A-Za-z_]\w*)\s*:?=\s*\$?\.Values((?:\.[A-Za-z_]\w*)+)")
_ACTION = re.compile(r"\{\{(.*?)\}\}", re.S)
_OPENERS = {"if", "range", "with", "define", "block"}


def _value_paths(text: str) -> set[str]:
    """Every `.Values.a.b` path a template reads, directly or through `$v := .Values.a`."""
    paths = {m.group(1)[1:] for m in _VALUES_REF.finditer(text)}
    for var, base in _VAR_BINDING.findall(text):
        for m in re.finditer(re.escape(var) + r"((?:\.[A-Za-z_]\w*)+)", text):
            paths.add(base[1:] + m.group(1))
    return paths


@pytest.mark.parametrize("template", TEMPLATE_FILES, ids=lambda p: p.name)
def test_template_values_exist(template: Path) -> None:
    values = _load("values.yaml")
    missing = []
    for path in sorted(_value_paths(template.read_text())):
        node: Any = values
        for key in path.split("."):
            if not (isinstance(node, dict) and key in node):
                missing.append(path)
                break
            node = node[key]
    assert not missing, f"{template.name} reads values that values.yaml lacks: {missing}"


def test_value_path_scan_sees_the_templates() -> None:
    """Guard the regexes above: they must find the references the chart is built on."""
    paths = set().union(*(_value_paths(p.read_text()) for p in TEMPLATE_FILES))
    assert {
        "worker.replicas",
        "redis.enabled",
        "redis.url",
        "control.heartbeatTimeout",
        "worker.spec.method",
        "worker.spec.drafter.path",  # through $spec := .Values.worker.spec
    } <= paths


@pytest.mark.parametrize("template", TEMPLATE_FILES, ids=lambda p: p.name)
def test_template_delimiters_balanced(template: Path) -> None:
    text = template.read_text()
    depth = 0
    for m in re.finditer(r"\{\{|\}\}", text):
        depth += 1 if m.group() == "{{" else -1
        line = text.count("\n", 0, m.start()) + 1
        assert depth in (0, 1), f"{template.name}:{line}: nested or unopened {m.group()!r}"
    assert depth == 0, f"{template.name}: unclosed '{{{{'"
    # Trim markers need whitespace next to them ("{{-x" is a parse error in Go templates).
    assert not re.search(r"\{\{-[^\s]", text), f"{template.name}: '{{{{-' without a space"
    assert not re.search(r"[^\s]-\}\}", text), f"{template.name}: '-}}}}' without a space"


@pytest.mark.parametrize("template", TEMPLATE_FILES, ids=lambda p: p.name)
def test_template_blocks_balanced(template: Path) -> None:
    stack: list[str] = []
    for m in _ACTION.finditer(template.read_text()):
        body = m.group(1).strip().removeprefix("-").removesuffix("-").strip()
        if body.startswith("/*"):
            continue
        word = re.match(r"[A-Za-z]*", body).group()
        if word in _OPENERS:
            stack.append(word)
        elif word == "end":
            assert stack, f"{template.name}: {{{{ end }}}} without an opening block"
            stack.pop()
        elif word == "else":
            assert stack and stack[-1] in {"if", "with", "range"}, f"{template.name}: stray else"
    assert not stack, f"{template.name}: unclosed {stack}"


def test_included_templates_are_defined() -> None:
    texts = {p.name: p.read_text() for p in TEMPLATE_FILES}
    defined = set(re.findall(r'\{\{-?\s*define\s+"([^"]+)"', "".join(texts.values())))
    for name, text in texts.items():
        for used in re.findall(r'\binclude\s+"([^"]+)"', text):
            assert used in defined, f"{name} includes undefined template {used!r}"


def test_redis_manifests_are_guarded() -> None:
    text = (TEMPLATES / "redis.yaml").read_text()
    assert re.match(r"\s*\{\{-?\s*if\s+\.Values\.redis\.enabled\s*-?\}\}", text)
    assert re.search(r"\{\{-?\s*end\s*-?\}\}\s*$", text)


# --- helm lint / helm template (only with a helm binary) ------------------------------------

EXTERNAL_REDIS = ["--set", "redis.enabled=false,redis.url=redis://r:6379/0"]
THREE_WORKERS = ["--set", "worker.replicas=3"]
AUTH = ["--set", "auth.secretName=specserve-keys"]  # the chart renders nothing without auth


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    """`helm <args>` (only `template` and `lint` are used): the binary, or the same through the
    SDK, with the binary's exit status, stdout and stderr."""
    if HELM is not None:
        return subprocess.run(
            [HELM, *args], capture_output=True, text=True, timeout=120, check=False
        )
    command, *rest = args
    values: dict[str, Any] = {}
    positional, namespace, strict = [], "default", False
    words = iter(rest)
    for word in words:
        if word == "--set":
            _merge(values, helm_python.parse_set_string(next(words)))
        elif word == "--set-string":
            _merge(values, helm_python.parse_set_string_values(next(words)))
        elif word == "--namespace":
            namespace = next(words)
        elif word == "--strict":
            strict = True
        else:
            positional.append(word)
    try:
        if command == "template":
            name, chart = positional
            rendered = helm_python.Chart.load(chart).render(
                values, name=name, namespace=namespace, is_install=True
            )
            manifests = [
                f"---\n# Source: {path}\n{text}\n"
                for path, text in sorted(rendered.items())
                if path.endswith(".yaml") and text.strip()
            ]
            return subprocess.CompletedProcess(args, 0, "".join(manifests), "")
        assert command == "lint", command
        (chart,) = positional
        report = helm_python.lint(chart, values, strict=strict)
        # helm's severities: 1 info, 2 warning, 4 error; --strict fails on warnings too
        worst = 2 if strict else 4
        failed = report["errors"] or [m for m in report["messages"] if m["severity"] >= worst]
        return subprocess.CompletedProcess(args, int(bool(failed)), json.dumps(report), "")
    except helm_python.HelmError as exc:
        return subprocess.CompletedProcess(args, 1, "", str(exc))


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _render(*set_args: str) -> dict[tuple[str, str], dict[str, Any]]:
    proc = _helm("template", RELEASE, str(CHART), "--namespace", "test", *AUTH, *set_args)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    objects = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(objects) == len(docs), "two manifests share a kind and a name"
    return objects


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


WRITABLE = ["/tmp", "/var/cache/specserve"]  # emptyDirs under a read-only root filesystem


COPY_MODEL = ["--set", "model.copyFrom.image=registry.example.com/models/llama-3.1-8b:v1"]


def _volumes(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}


def _flag(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} not in {args}"
    return args[args.index(flag) + 1]


@needs_helm
@pytest.mark.parametrize("set_args", [[], EXTERNAL_REDIS + THREE_WORKERS], ids=["default", "set"])
def test_helm_lint(set_args: list[str]) -> None:
    proc = _helm("lint", "--strict", str(CHART), *AUTH, *set_args)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@needs_helm
def test_helm_template_defaults() -> None:
    objs = _render()
    control = objs[("Deployment", f"{FULLNAME}-control")]
    worker = objs[("Deployment", f"{FULLNAME}-worker")]
    service = objs[("Service", f"{FULLNAME}-control")]
    redis = objs[("Deployment", f"{FULLNAME}-redis")]
    assert ("Service", f"{FULLNAME}-redis") in objs

    # Selectors select their own pods, and the Service selects the control plane.
    for dep in (control, worker, redis):
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert (
        service["spec"]["selector"].items()
        <= control["spec"]["template"]["metadata"]["labels"].items()
    )
    assert {(p["name"], p["port"]) for p in service["spec"]["ports"]} == {
        ("zmq", 5555),
        ("zmq-workers", 5556),
        ("metrics", 9090),
    }

    c = _container(control)
    assert c["image"] == "specserve:0.1.0"
    assert c["command"] == ["specserve", "control"]
    assert _flag(c["args"], "--bind") == "tcp://*:5555"
    assert _flag(c["args"], "--worker-bind") == "tcp://*:5556"
    assert _flag(c["args"], "--keys") == "/etc/specserve/keys"
    assert "--insecure" not in c["args"]
    assert _flag(c["args"], "--redis-url") == f"redis://{FULLNAME}-redis:6379/0"
    assert _flag(c["args"], "--model") == "smollm2-135m"
    assert _flag(c["args"], "--metrics-port") == "9090"
    assert _flag(c["args"], "--routing") == "prefix"
    assert float(_flag(c["args"], "--heartbeat-timeout")) == 3.0
    assert "--log-json" not in c["args"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"zmq": 5555, "zmq-workers": 5556, "metrics": 9090}
    keys = _volumes(control)["keys"]
    assert keys["secret"]["secretName"] == "specserve-keys"
    assert {i["path"] for i in keys["secret"]["items"]} == {
        "control.key_secret", "workers/worker.key", "clients/client.key",
    }  # fmt: skip
    assert c["livenessProbe"]["tcpSocket"]["port"] in ("zmq", 5555)
    assert control["spec"]["replicas"] == 1
    annotations = control["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9090"

    w = _container(worker)
    assert worker["spec"]["replicas"] == 2
    assert w["command"] == ["specserve", "worker"]
    assert _flag(w["args"], "--control") == f"tcp://{FULLNAME}-control:5556"
    assert _flag(w["args"], "--keys") == "/etc/specserve/keys"
    keys = _volumes(worker)["keys"]
    assert {i["path"] for i in keys["secret"]["items"]} == {
        "control.key", "workers/worker.key_secret",
    }  # fmt: skip
    assert _flag(w["args"], "--worker-id") == "$(POD_NAME)"
    assert _flag(w["args"], "--model") == "smollm2-135m"
    assert _flag(w["args"], "--device") == "cpu"
    assert "--spec-method" not in w["args"]
    (env,) = (e for e in w["env"] if e["name"] == "POD_NAME")
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    ready = ["test", "-f", "/tmp/specserve-ready"]
    assert _flag(w["args"], "--ready-file") == "/tmp/specserve-ready"
    assert w["readinessProbe"]["exec"]["command"] == ready
    assert w["startupProbe"]["exec"]["command"] == ready
    startup = w["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 600
    assert _flag(c["args"], "--ready-file") == "/tmp/specserve-ready"
    assert c["readinessProbe"]["exec"]["command"] == ready
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 0

    r = _container(redis)
    assert r["image"] == "redis:7-alpine"
    assert r["args"] == ["--save", "", "--appendonly", "no"]


@needs_helm
def test_every_pod_runs_restricted() -> None:
    """Kubernetes' restricted profile everywhere: non-root, no escalation, no capabilities,
    RuntimeDefault seccomp, a read-only root filesystem with emptyDirs where a pod writes."""
    objs = _render("--set", "api.apiKeySecret=api-keys")
    deployments = [d for (kind, _), d in objs.items() if kind == "Deployment"]
    assert {d["metadata"]["name"] for d in deployments} == {
        f"{FULLNAME}-{name}" for name in ("control", "worker", "api", "redis")
    }
    for deployment in deployments:
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        assert container["securityContext"] == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        empty_dirs = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
        mounted = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        if deployment["metadata"]["name"].endswith("-redis"):
            assert pod["securityContext"]["runAsUser"] == 999  # the image's redis user
            assert mounted["data"] == "/data" and "data" in empty_dirs
        else:
            assert {mounted[n] for n in empty_dirs} == set(WRITABLE)
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["SPECSERVE_CACHE_DIR"] == "/var/cache/specserve"
            # Secret files are root-owned: the non-root user reads them through its fsGroup
            for volume in pod["volumes"]:
                if "secret" in volume:
                    assert volume["secret"]["defaultMode"] == 0o440
                    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


@needs_helm
def test_helm_template_the_http_api() -> None:
    objs = _render("--set", "api.apiKeySecret=api-keys,api.replicas=2,api.servedModelName=m")
    api = objs[("Deployment", f"{FULLNAME}-api")]
    service = objs[("Service", f"{FULLNAME}-api")]
    assert api["spec"]["replicas"] == 2
    assert (
        service["spec"]["selector"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    )
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("http", 8000)]
    a = _container(api)
    assert a["command"] == ["specserve", "api"]
    assert _flag(a["args"], "--control") == f"tcp://{FULLNAME}-control:5555"
    assert _flag(a["args"], "--keys") == "/etc/specserve/keys"
    assert _flag(a["args"], "--api-key-file") == "/etc/specserve/api/api-keys"
    assert _flag(a["args"], "--served-model-name") == "m"
    assert a["readinessProbe"]["httpGet"]["path"] == "/health"
    volumes = {v["name"]: v for v in api["spec"]["template"]["spec"]["volumes"]}
    assert {i["path"] for i in volumes["keys"]["secret"]["items"]} == {
        "control.key", "clients/client.key_secret",
    }  # fmt: skip
    assert volumes["api-keys"]["secret"]["secretName"] == "api-keys"
    worker = _container(objs[("Deployment", f"{FULLNAME}-worker")])
    assert _flag(worker["args"], "--drain-timeout") == "25"  # grace period 30 s, less 5
    assert not [k for k in _render("--set", "api.enabled=false") if k[1] == f"{FULLNAME}-api"]


@needs_helm
def test_helm_template_external_redis_three_workers() -> None:
    objs = _render(*EXTERNAL_REDIS, *THREE_WORKERS)
    assert not [key for key in objs if key[1] == f"{FULLNAME}-redis"]
    worker = objs[("Deployment", f"{FULLNAME}-worker")]
    assert worker["spec"]["replicas"] == 3
    w_args = _container(worker)["args"]
    assert _flag(w_args, "--control") == f"tcp://{FULLNAME}-control:5556"
    c_args = _container(objs[("Deployment", f"{FULLNAME}-control")])["args"]
    assert _flag(c_args, "--redis-url") == "redis://r:6379/0"


@needs_helm
def test_helm_template_gpu_spec_decoding_and_pvcs() -> None:
    objs = _render(
        "--set",
        "worker.device=cuda:0,worker.dtype=bfloat16,worker.spec.method=eagle3",
        "--set",
        "worker.spec.numSpecTokens=5,worker.spec.drafter.path=/drafters/e3",
        "--set",
        "worker.spec.drafter.pvc=drafters,model.pvc=models,model.path=/models/m",
        "--set-string",
        r"worker.resources.limits.nvidia\.com/gpu=1",
        "--set",
        "control.logJson=true,worker.kvCacheMemoryMb=2000000",
    )
    worker = objs[("Deployment", f"{FULLNAME}-worker")]
    w = _container(worker)
    assert _flag(w["args"], "--device") == "cuda:0"
    assert _flag(w["args"], "--dtype") == "bfloat16"
    assert _flag(w["args"], "--spec-method") == "eagle3"
    assert _flag(w["args"], "--num-spec-tokens") == "5"
    assert _flag(w["args"], "--drafter") == "/drafters/e3"
    assert _flag(w["args"], "--model") == "/models/m"
    assert _flag(w["args"], "--kv-cache-memory-mb") == "2000000"  # not 2e+06
    assert w["resources"]["limits"]["nvidia.com/gpu"] == "1"
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in worker["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert claims == {"model": "models", "drafter": "drafters"}
    mounts = {m["mountPath"] for m in w["volumeMounts"]}
    assert mounts == {"/models", "/drafters", "/etc/specserve/keys", *WRITABLE}

    control = objs[("Deployment", f"{FULLNAME}-control")]
    c = _container(control)
    assert _flag(c["args"], "--model") == "/models/m"
    assert "--log-json" in c["args"]
    assert [m["mountPath"] for m in c["volumeMounts"]] == [
        *WRITABLE, "/models", "/etc/specserve/keys",
    ]  # fmt: skip


@needs_helm
@pytest.mark.parametrize(
    ("set_args", "message"),
    [
        (["--set", "redis.enabled=false"], "redis.url (or redis.urlSecret) is required"),
        (["--set", "worker.spec.method=eagle3"], "worker.spec.drafter.path is required"),
        # (refused by values.schema.json before any template runs)
        (["--set", "worker.spec.method=medusa"], "at '/worker/spec/method': value must be one"),
        (["--set", "control.routing=random"], "at '/control/routing': value must be one of"),
        (
            ["--set", "model.pvc=models,model.path=/models/m", *COPY_MODEL],
            "set model.pvc or model.copyFrom.image, not both",
        ),
        (COPY_MODEL, "model.path is required with model.copyFrom.image"),
    ],
)
def test_helm_template_refuses_bad_values(set_args: list[str], message: str) -> None:
    proc = _helm("template", RELEASE, str(CHART), *AUTH, *set_args)
    assert proc.returncode != 0
    assert message in proc.stderr


@needs_helm
def test_helm_template_refuses_to_run_without_auth_unless_insecure() -> None:
    proc = _helm("template", RELEASE, str(CHART))
    assert proc.returncode != 0
    assert "set auth.secretName to a Secret made from `specserve keys generate`" in proc.stderr
    objs = _render("--set", "auth.secretName=,auth.insecure=true")
    for name in ("control", "worker"):
        args = _container(objs[("Deployment", f"{FULLNAME}-{name}")])["args"]
        assert "--insecure" in args and "--keys" not in args


# --- values.schema.json (helm enforces it on install, upgrade, template and lint) -------------


def _schema_errors(values: dict[str, Any]) -> list[str]:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    return ["/".join(map(str, e.path)) + ": " + e.message for e in validator.iter_errors(values)]


def _with(values: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(values)
    *parents, last = path.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return out


def test_the_default_values_meet_the_schema() -> None:
    assert _schema_errors(_load("values.yaml")) == []


@pytest.mark.parametrize(
    ("path", "value", "error"),
    [
        ("workers.replicas", 4, "Additional properties are not allowed ('workers' was unexpected)"),
        ("worker.replica", 4, "Additional properties are not allowed ('replica' was unexpected)"),
        ("worker.replicas", "four", "worker/replicas: 'four' is not of type 'integer'"),
        ("worker.device", "tpu", "worker/device: 'tpu' does not match"),
        ("worker.spec.method", "medusa", "worker/spec/method: 'medusa' is not one of"),
        ("control.routing", "random", "control/routing: 'random' is not one of"),
        ("control.port", 70000, "control/port: 70000 is greater than the maximum of 65535"),
        ("api.maxConcurrentRequests", 0, "api/maxConcurrentRequests: 0 is less than the minimum"),
        ("redis.url", "http://r:6379", "redis/url: 'http://r:6379' does not match"),
        ("image.pullPolicy", "Sometimes", "image/pullPolicy: 'Sometimes' is not one of"),
        ("model.copyFrom.sizeLimit", "lots", "model/copyFrom/sizeLimit: 'lots' does not match"),
        ("model.copyFrom.sourcePath", "model", "model/copyFrom/sourcePath: 'model' does not match"),
    ],
)
def test_misspelt_or_impossible_values_are_refused(path: str, value: Any, error: str) -> None:
    errors = _schema_errors(_with(_load("values.yaml"), path, value))
    assert len(errors) == 1 and error in errors[0], errors


def test_every_value_is_in_the_schema() -> None:
    """Each key of values.yaml is declared, so the schema refuses only what the chart lacks."""
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(values: dict[str, Any], node: dict[str, Any], where: str) -> None:
        props = node.get("properties")
        if props is None:  # a free-form map (annotations, resources, affinity...)
            return
        for key, value in values.items():
            assert key in props, f"{where}{key} is not in values.schema.json"
            if isinstance(value, dict):
                walk(value, props[key], f"{where}{key}.")

    walk(_load("values.yaml"), schema, "")


@needs_helm
def test_helm_refuses_a_misspelt_value() -> None:
    proc = _helm("template", RELEASE, str(CHART), *AUTH, "--set", "workers.replicas=4")
    assert proc.returncode != 0 and "workers" in proc.stderr


@needs_helm
def test_redis_passwords_never_reach_pod_arguments() -> None:
    """The bundled Redis with a password from a Secret, and an external Redis whose URL holds
    one: the control plane gets the URL through its environment, from the Secret."""
    objs = _render("--set", "redis.auth.existingSecret=redis-auth")
    redis = _container(objs[("Deployment", f"{FULLNAME}-redis")])
    assert _flag(redis["args"], "--requirepass") == "$(REDIS_PASSWORD)"
    (password,) = redis["env"]
    assert password["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "redis-password"}
    control = _container(objs[("Deployment", f"{FULLNAME}-control")])
    assert "--redis-url" not in control["args"]
    env = {e["name"]: e for e in control["env"]}
    names = [e["name"] for e in control["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("SPECSERVE_REDIS_URL")  # for $(...)
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-auth"
    assert env["SPECSERVE_REDIS_URL"]["value"] == (
        f"redis://:$(REDIS_PASSWORD)@{FULLNAME}-redis:6379/0"
    )
    objs = _render("--set", "redis.enabled=false,redis.urlSecret=redis-url")
    control = _container(objs[("Deployment", f"{FULLNAME}-control")])
    assert "--redis-url" not in control["args"]
    env = {e["name"]: e for e in control["env"]}
    assert env["SPECSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-url", "key": "redis-url",
    }  # fmt: skip
    assert not [key for key in objs if key[1] == f"{FULLNAME}-redis"]


@needs_helm
def test_kv_cache_sized_by_fraction_of_free_memory() -> None:
    objs = _render("--set", "worker.kvCacheMemoryFraction=0.9")
    args = _container(objs[("Deployment", f"{FULLNAME}-worker")])["args"]
    assert _flag(args, "--kv-cache-memory-fraction") == "0.9"
    assert "--kv-cache-memory-mb" not in args
    args = _container(_render()[("Deployment", f"{FULLNAME}-worker")])["args"]
    assert _flag(args, "--kv-cache-memory-mb") == "512"
    assert _schema_errors(_with(_load("values.yaml"), "worker.kvCacheMemoryFraction", 1.5))


@needs_helm
def test_service_monitors_and_keda_autoscaling() -> None:
    assert not [k for k in _render() if k[0] in ("ServiceMonitor", "ScaledObject")]
    objs = _render(
        "--set", "metrics.serviceMonitor.enabled=true,metrics.serviceMonitor.labels.release=prom",
        "--set", "worker.autoscaling.enabled=true,worker.autoscaling.maxReplicas=6",
        "--set", "worker.autoscaling.prometheusAddress=http://prometheus.monitoring:9090",
    )  # fmt: skip
    control = objs[("Deployment", f"{FULLNAME}-control")]["spec"]["template"]["metadata"]
    api = objs[("Deployment", f"{FULLNAME}-api")]["spec"]["template"]["metadata"]
    for name, pod, port in ((FULLNAME, control, "metrics"), (f"{FULLNAME}-api", api, "http")):
        monitor = objs[("ServiceMonitor", name)]
        assert monitor["metadata"]["labels"]["release"] == "prom"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod["labels"].items()
        assert monitor["spec"]["endpoints"] == [
            {"port": port, "path": "/metrics", "interval": "15s"}
        ]
    scaled = objs[("ScaledObject", f"{FULLNAME}-worker")]
    assert scaled["spec"]["scaleTargetRef"] == {"name": f"{FULLNAME}-worker"}
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, 6)
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["metadata"]["query"] == 'sum(specserve_queue_depth{namespace="test"})'
    assert trigger["metadata"]["threshold"] == "8"
    refused = _helm(
        "template", RELEASE, str(CHART), *AUTH, "--set", "worker.autoscaling.enabled=true"
    )
    assert refused.returncode != 0 and "prometheusAddress is required" in refused.stderr


KUBERNETES = "1.30"  # the oldest Kubernetes the chart supports


@needs_helm
@pytest.mark.parametrize(
    "set_args",
    [
        [],
        EXTERNAL_REDIS + THREE_WORKERS,
        [
            "--set",
            "api.apiKeySecret=api-keys,model.pvc=models,model.path=/models/m",
            "--set",
            "worker.spec.method=eagle3,worker.spec.drafter.path=/drafters/e3",
            "--set",
            "worker.spec.drafter.pvc=drafters,worker.device=cuda:0",
            "--set-string",
            r"worker.resources.limits.nvidia\.com/gpu=1",
            "--set-string",
            "worker.extraArgs={--max-model-len,8192}",
        ],
        ["--set", "auth.secretName=,auth.insecure=true,api.enabled=false"],
        ["--set", "redis.auth.existingSecret=redis-auth"],
        [*COPY_MODEL, "--set", "model.path=/models/llama"],
    ],
    ids=[
        "default",
        "external-redis",
        "gpu-eagle3-api-keys",
        "insecure-no-api",
        "redis-auth",
        "model-copied-from-an-image",
    ],
)
def test_rendered_manifests_meet_the_kubernetes_schemas(set_args: list[str]) -> None:
    """Every rendered object is valid for Kubernetes 1.30, strictly (no unknown fields), as
    the API server would check it."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objs = _render(*set_args)
    assert objs
    for (kind, name), obj in objs.items():
        try:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{kind} {name}: {exc.message} at {list(exc.path)}")


@needs_helm
def test_the_model_is_copied_out_of_an_image_before_the_pods_start(tmp_path: Path) -> None:
    """With model.copyFrom.image, each control, worker and API pod gets an init container that
    copies the checkpoint into an emptyDir, run as restricted as the rest; the pods mount it
    read-only and get --model inside it. The rendered copy command, run here with real `cp` on a
    checkpoint directory (paths mapped to tmp_path), puts the files where --model points."""
    objs = _render(
        *COPY_MODEL,
        "--set",
        "model.path=/models/llama,model.copyFrom.sourcePath=/model/,model.copyFrom.sizeLimit=20Gi",
        "--set",
        "api.apiKeySecret=api-keys",
    )
    commands = set()
    for name in ("control", "worker", "api"):
        pod = objs[("Deployment", f"{FULLNAME}-{name}")]["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["image"] == "registry.example.com/models/llama-3.1-8b:v1"
        assert (
            init["securityContext"]
            == _container({"spec": {"template": {"spec": pod}}})["securityContext"]
        )
        assert init["volumeMounts"] == [{"name": "model", "mountPath": "/models"}]
        assert _volumes({"spec": {"template": {"spec": pod}}})["model"] == {
            "name": "model",
            "emptyDir": {"sizeLimit": "20Gi"},
        }
        (main,) = pod["containers"]
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in main["volumeMounts"]
        if name != "api":
            assert _flag(main["args"], "--model") == "/models/llama"
        commands.add(tuple(init["command"]))
    (command,) = commands
    assert list(command) == ["cp", "-R", "/model/.", "/models/"]

    image_root, pod_root = tmp_path / "image", tmp_path / "pod"
    (image_root / "model" / "llama").mkdir(parents=True)
    (image_root / "model" / "llama" / "config.json").write_text("{}")
    (pod_root / "models").mkdir(parents=True)
    mapped = [command[0], command[1], str(image_root) + command[2], str(pod_root) + command[3]]
    subprocess.run(mapped, check=True)
    assert (pod_root / "models" / "llama" / "config.json").read_text() == "{}"
