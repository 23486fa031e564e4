"""Checks the Kubernetes manifests of deploy/kubernetes (run by scripts/check-kubernetes.sh,
from the repository root, in the venv it makes):

1. builds every kustomize tree with render.py (every listed file exists and parses, every
   object has apiVersion, kind and metadata.name, no id twice) and, where a `kubectl` is on
   PATH, compares the result with `kubectl kustomize`;
2. validates the core objects against the Kubernetes OpenAPI schemas of kubernetes-validate
   in strict mode (unknown fields are errors), for each version in KUBERNETES_VERSIONS;
3. validates the custom resources (and the prometheus-adapter values) against our own
   transcriptions of their upstream schemas, tests/kubernetes/schemas/*.json;
4. checks invariants between the objects that no schema sees (see the functions below).

One line per tree, file and object (with -v, per check too); exit status 1 on any failure.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from render import Build, RenderError, describe, load_documents  # noqa: E402

DEPLOY = Path("deploy/kubernetes")
SCHEMAS = Path("tests/kubernetes/schemas")
# The trees users apply, and the overlay of README.md that adds the keda component.
TREES = [DEPLOY, DEPLOY / "inference-gateway", Path("tests/kubernetes/overlays/all")]
# Files under deploy/kubernetes that no tree lists, on purpose.
NOT_RESOURCES = {DEPLOY / "prometheus-adapter-values.yaml": "prometheus-adapter-values.json"}
# The oldest Kubernetes these manifests are meant for, and the newest kubernetes-validate knows.
KUBERNETES_VERSIONS = ["1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2])]
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
    ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-v1.json",
    ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-v1alpha1.json",
}
# The service's defaults (host/src/serve/cli.rs, the image's ENV) where the args leave them.
DEFAULTS = {"port": "8080", "device": "cpu", "shutdown-delay": "0", "shutdown-grace": "30",
            "timeout": "120", "max-instances": "128"}
QUEUE_WAIT_S = 60  # docs/service.md: a request waits at most 60 s for a place
HOST_ENV_PREFIX = "WASI_NN_HOST_"  # host/src/switches.rs
QUEUE_METRIC = "wasi_nn_requests_queued"


class Report:
    """Checks grouped by what they are about (a tree, a file, an object): one line a group,
    with every check of a failed group (and, with -v, of every group) listed under it."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.groups: dict[str, list] = {}
        self.notes: dict[str, list] = {}
        self.passed = self.failed = 0

    def check(self, ok: bool, where: str, what: str, detail: str = "") -> bool:
        self.groups.setdefault(where, []).append((ok, what, detail))
        if ok:
            self.passed += 1
        else:
            self.failed += 1
        return ok

    def note(self, where: str, text: str) -> None:
        self.notes.setdefault(where, []).append(text)

    def flush(self) -> None:
        for where, checks in self.groups.items():
            bad = [c for c in checks if not c[0]]
            notes = "; ".join(self.notes.get(where, []))
            summary = f"{notes}; " if notes else ""
            count = f"{len(checks)} check" + ("s" if len(checks) > 1 else "")
            print(f"  {'FAIL' if bad else 'ok  '}  {where}: {summary}{count}"
                  + (f", {len(bad)} failed" if bad else ""))
            for ok, what, detail in checks:
                if not ok or self.verbose:
                    print(f"          {'ok  ' if ok else 'FAIL'} {what}"
                          + (f": {detail}" if detail and not ok else ""))
        self.groups.clear()
        self.notes.clear()


# --- helpers -----------------------------------------------------------------------------


def of_kind(objects: list, kind: str) -> list:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list, kind: str, name: str):
    return next((o for o in of_kind(objects, kind) if o["metadata"]["name"] == name), None)


def selects(selector: dict, labels: dict) -> bool:
    """A selector (matchLabels, or a Service's plain map) that is non-empty and matches."""
    if "matchExpressions" in selector:
        raise ValueError("matchExpressions: not implemented by check.py")
    match = selector["matchLabels"] if "matchLabels" in selector else selector
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def parse_args(args: list) -> dict:
    """`--flag=value`, `--flag value` and bare `--flag` (True)."""
    flags, i = {}, 0
    while i < len(args):
        arg = str(args[i])
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq:
                if i + 1 < len(args) and not str(args[i + 1]).startswith("--"):
                    value, i = str(args[i + 1]), i + 1
                else:
                    value = True
            flags[name] = value
        i += 1
    return flags


def seconds(duration: str) -> float:
    """A Gateway API / Prometheus duration such as 1m30s or 300s."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a duration: {duration}")
    return sum(int(n) * units[u] for n, u in parts)


def quantity(value) -> float:
    text = str(value)
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    return float(text)


class Server:
    """The wasi-nn-host Deployment's pod and container, and what its args say."""

    def __init__(self, deployment: dict):
        self.deployment = deployment
        self.template = deployment["spec"]["template"]
        self.pod = self.template["spec"]
        self.labels = self.template["metadata"].get("labels", {})
        self.container = next((c for c in self.pod["containers"]
                               if c["name"] == "wasi-nn-host"), self.pod["containers"][0])
        self.flags = parse_args(self.container.get("args", []))
        self.env = {e["name"]: e.get("value") for e in self.container.get("env", [])}
        self.ports = {p.get("name"): p["containerPort"] for p in self.container.get("ports", [])}

    def flag(self, name: str) -> str:
        if name in self.flags:
            return self.flags[name]
        if name == "port" and "WASI_NN_SERVE_PORT" in self.env:
            return self.env["WASI_NN_SERVE_PORT"]
        if name == "max-concurrent":
            return self.flag("max-instances")
        return DEFAULTS.get(name, "0")

    def port(self, ref) -> int | None:
        """A port by name or number, if the container has it."""
        if isinstance(ref, int):
            return ref if ref in self.ports.values() else None
        return self.ports.get(ref)


# --- schema validation -------------------------------------------------------------------


def load_schema(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / name).read_text(encoding="utf-8"))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(validator, instance) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in sorted(validator.iter_errors(instance), key=lambda e: list(e.path))]


def validate_object(report: Report, where: str, obj: dict, seen: dict) -> bool:
    """Against our transcription of its CRD, or the Kubernetes schemas; `seen` keeps the
    results of objects that are the same in several trees. True when valid."""
    key = json.dumps(obj, sort_keys=True)
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd:
        report.note(where, f"{obj['apiVersion']} against tests/kubernetes/schemas/{crd}")
        if key not in seen:
            seen[key] = schema_errors(load_schema(crd), obj)
        return report.check(not seen[key], where, f"schema {crd}", "; ".join(seen[key]))
    report.note(where, f"{obj['apiVersion']} against Kubernetes "
                f"{' and '.join(KUBERNETES_VERSIONS)} (strict)")
    for version in KUBERNETES_VERSIONS:
        if (key, version) not in seen:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
                seen[key, version] = ""
            except kubernetes_validate.ValidationError as e:
                path = "/".join(map(str, e.absolute_path)) or "(top)"
                seen[key, version] = f"{path}: {e.message}"
            except kubernetes_validate.SchemaNotFoundError as e:
                seen[key, version] = e.message + " (add a schema to CRD_SCHEMAS?)"
        report.check(not seen[key, version], where, f"Kubernetes {version} schema (strict)",
                     seen[key, version])
    return not any(seen[key, v] for v in KUBERNETES_VERSIONS)


# --- invariants --------------------------------------------------------------------------


def check_server(report: Report, where: str, s: Server, objects: list) -> None:
    d = s.deployment
    report.check(selects(d["spec"]["selector"], s.labels), where,
                 "the Deployment's selector matches its pod template's labels")

    gpus = s.container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    report.check(str(gpus) == "1" and s.flag("device") == "cuda:0", where,
                 "one GPU a pod (limits nvidia.com/gpu: 1) and --device=cuda:0, the only one "
                 "it sees", f"gpu limit {gpus}, --device {s.flag('device')}")

    instances, concurrent = int(s.flag("max-instances")), int(s.flag("max-concurrent"))
    warm = int(s.flag("warm-contexts"))
    report.check(concurrent <= instances and warm <= instances, where,
                 f"--max-concurrent ({concurrent}) and --warm-contexts ({warm}) within "
                 f"--max-instances ({instances})")

    hook = s.container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        sleep = int(hook["sleep"]["seconds"])
    else:
        command = hook.get("exec", {}).get("command", [])
        sleep = int(command[1]) if len(command) == 2 and command[0].endswith("/sleep") else None
    grace, delay = int(s.flag("shutdown-grace")), int(s.flag("shutdown-delay"))
    period = int(d["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30))
    if report.check(sleep is not None, where, "a preStop hook that sleeps",
                    f"preStop is {hook}"):
        report.check(period > sleep + delay + grace, where,
                     f"terminationGracePeriodSeconds ({period}) > preStop sleep ({sleep}) + "
                     f"--shutdown-delay ({delay}) + --shutdown-grace ({grace})")
    # after SIGTERM /health answers 503 while the server still accepts: the readiness probe
    # must see that (the endpoint picker drops unready pods) before the delay is over
    readiness = s.container.get("readinessProbe") or {}
    unready_after = readiness.get("periodSeconds", 10) * readiness.get("failureThreshold", 3)
    report.check(unready_after <= delay, where,
                 f"readiness fails within {unready_after} s of SIGTERM, before the server stops "
                 f"accepting (--shutdown-delay {delay} s)")

    serve_port = int(s.flag("port"))
    report.check(s.port(serve_port) is not None, where,
                 f"the server's port ({serve_port}) is a containerPort", f"ports {s.ports}")
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = s.container.get(name)
        get = (probe or {}).get("httpGet", {})
        report.check(probe is not None and get.get("path") == "/health"
                     and s.port(get.get("port")) == serve_port, where,
                     f"{name}: GET /health on the server's port",
                     f"{get or probe}")
    liveness = s.container.get("livenessProbe") or {}
    window = liveness.get("periodSeconds", 10) * liveness.get("failureThreshold", 3)
    report.check(window > delay + grace, where,
                 f"liveness gives up after {window} s, longer than the drain "
                 f"({delay} + {grace} s)")
    startup = s.container.get("startupProbe") or {}
    window = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
    report.check(window >= 120, where,
                 f"the startup probe allows {window} s for loading and kernel compilation "
                 "(>= 120)")

    pod_sec, sec = s.pod.get("securityContext", {}), s.container.get("securityContext", {})
    report.check(
        (sec.get("runAsNonRoot", pod_sec.get("runAsNonRoot")) is True)
        and sec.get("allowPrivilegeEscalation") is False
        and sec.get("readOnlyRootFilesystem") is True
        and sec.get("capabilities", {}).get("drop") == ["ALL"],
        where, "non-root, no privilege escalation, read-only root, all capabilities dropped")

    mounts = {m["mountPath"]: m for m in s.container.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in s.pod.get("volumes", [])}
    for var in ("WASI_NN_HOST_CACHE", "CUDA_CACHE_PATH"):
        path = s.env.get(var)
        if path is None and var == "CUDA_CACHE_PATH":
            continue
        mount = next((m for p, m in mounts.items()
                      if path and (path == p or path.startswith(p.rstrip("/") + "/"))), None)
        volume = volumes.get(mount["name"]) if mount else None
        report.check(bool(mount) and not mount.get("readOnly")
                     and bool(volume) and ("emptyDir" in volume
                                           or "persistentVolumeClaim" in volume),
                     where, f"{var} ({path}) is on a writable volume (the root is read-only)")

    services = [o["metadata"]["name"] for o in of_kind(objects, "Service")]
    clash = [n for n in services
             if (n.upper().replace("-", "_") + "_").startswith(HOST_ENV_PREFIX)]
    if clash:
        report.check(s.pod.get("enableServiceLinks") is False, where,
                     f"enableServiceLinks: false (Service {clash[0]}'s variables would start "
                     f"with {HOST_ENV_PREFIX}, the host's switches)")

    autoscalers = [o for o in objects if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
                   and o["spec"]["scaleTargetRef"]["name"] == d["metadata"]["name"]]
    report.check(len(autoscalers) <= 1, where, "at most one autoscaler for the Deployment",
                 ", ".join(describe(o) for o in autoscalers))
    if autoscalers:
        report.check("replicas" not in d["spec"], where,
                     "no spec.replicas (the autoscaler owns the count)")


def check_service(report: Report, where: str, svc: dict, s: Server) -> None:
    report.check(selects(svc["spec"].get("selector", {}), s.labels), where,
                 "selects the server's pods")
    for port in svc["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        report.check(s.port(target) == int(s.flag("port")), where,
                     f"port {port['port']} -> targetPort {target}: the server's port")


def check_pdb(report: Report, where: str, pdb: dict, s: Server) -> None:
    report.check(selects(pdb["spec"]["selector"], s.labels), where, "selects the server's pods")


def target_ok(ref: dict, d: dict) -> bool:
    return (ref.get("apiVersion") == "apps/v1" and ref.get("kind") == "Deployment"
            and ref.get("name") == d["metadata"]["name"])


def check_hpa(report: Report, where: str, hpa: dict, s: Server, adapter_metric) -> None:
    spec = hpa["spec"]
    report.check(target_ok(spec["scaleTargetRef"], s.deployment), where,
                 "scaleTargetRef is the server's Deployment (apps/v1)")
    report.check(1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"], where,
                 f"1 <= minReplicas <= maxReplicas ({spec.get('minReplicas', 1)}, "
                 f"{spec['maxReplicas']})")
    metrics = [m for m in spec.get("metrics", []) if m["type"] == "Pods"]
    names = [m["pods"]["metric"]["name"] for m in metrics]
    report.check(names == [QUEUE_METRIC], where, f"scales on the Pods metric {QUEUE_METRIC}",
                 f"Pods metrics {names}")
    report.check(adapter_metric in names, where,
                 "the metric is the one prometheus-adapter-values.yaml exposes",
                 f"adapter exposes {adapter_metric}")


def check_podmonitor(report: Report, where: str, pm: dict, s: Server) -> None:
    spec = pm["spec"]
    report.check(selects(spec["selector"], s.labels), where, "selects the server's pods")
    for label in spec.get("podTargetLabels", []):
        report.check(label in s.labels, where, f"podTargetLabels: the pods carry {label}")
    for ep in spec.get("podMetricsEndpoints", []):
        report.check(s.port(ep.get("port")) == int(s.flag("port")) and
                     ep.get("path") == "/metrics" and seconds(ep.get("interval", "30s")) == 15,
                     where, f"scrapes /metrics on port {ep.get('port')} every "
                     f"{ep.get('interval')} (15 s)")


def check_inferencepool(report: Report, where: str, pool: dict, s: Server) -> None:
    spec = pool["spec"]
    report.check(selects(spec["selector"], s.labels), where, "selects the server's pods")
    numbers = [p["number"] for p in spec["targetPorts"]]
    report.check(numbers == [int(s.flag("port"))] and s.port(numbers[0]) is not None, where,
                 f"targetPorts {numbers}: the server's container port")


def check_httproute(report: Report, where: str, route: dict, objects: list, s: Server) -> None:
    for rule in route["spec"]["rules"]:
        for ref in rule.get("backendRefs", []):
            kind = ref.get("kind", "Service")
            ok = (ref.get("group") == "inference.networking.k8s.io" and kind == "InferencePool"
                  and named(objects, kind, ref["name"]) is not None)
            report.check(ok, where, f"backendRef {kind}/{ref['name']}: an InferencePool of "
                         "this tree")
        least = QUEUE_WAIT_S + int(s.flag("timeout"))
        request = rule.get("timeouts", {}).get("request")
        report.check(request is not None and seconds(request) >= least, where,
                     f"timeouts.request ({request}) >= the longest a request lasts "
                     f"({QUEUE_WAIT_S} s queued + --timeout {s.flag('timeout')} s)")
    for parent in route["spec"].get("parentRefs", []):
        report.check(parent.get("kind", "Gateway") == "Gateway", where,
                     f"parentRef {parent['name']} is a Gateway")


def check_scaledobject(report: Report, where: str, so: dict, s: Server, objects: list,
                       base_hpa) -> None:
    spec = so["spec"]
    report.check(target_ok(spec["scaleTargetRef"], s.deployment), where,
                 "scaleTargetRef is the server's Deployment (apps/v1)")
    report.check(1 <= spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100), where,
                 "1 <= minReplicaCount <= maxReplicaCount (never to zero)")
    monitors = of_kind(objects, "PodMonitor")
    kept = {l for pm in monitors for l in pm["spec"].get("podTargetLabels", [])}
    for trigger in spec["triggers"]:
        query = trigger["metadata"].get("query", "")
        labels = dict(re.findall(r'(\w+)="([^"]*)"', query))
        wanted = {re.sub(r"[^a-zA-Z0-9_]", "_", k): (k, v) for k, v in s.labels.items()
                  if k in kept}
        ok = QUEUE_METRIC in query and bool(labels) and all(
            k in wanted and wanted[k][1] == v for k, v in labels.items() if k != "namespace")
        report.check(ok, where, f"query reads {QUEUE_METRIC} by labels the PodMonitor keeps "
                     "and the pods carry", query)
    if base_hpa is not None:
        h = base_hpa["spec"]
        target = [m["pods"]["target"]["averageValue"] for m in h["metrics"]
                  if m["type"] == "Pods"]
        same = (spec.get("minReplicaCount") == h.get("minReplicas", 1)
                and spec.get("maxReplicaCount") == h["maxReplicas"]
                and [quantity(t["metadata"]["threshold"]) for t in spec["triggers"]]
                == [quantity(v) for v in target]
                and spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
                .get("behavior") == h.get("behavior"))
        report.check(same, where, "the same policy as the base's HPA (replicas, target, "
                     "behavior)")


def check_adapter(report: Report, values: dict) -> str | None:
    """The adapter rule's checks; returns the metric name it exposes."""
    where = f"{DEPLOY / 'prometheus-adapter-values.yaml'}"
    exposed = None
    for rule in values.get("rules", {}).get("custom", []):
        matches = rule.get("name", {}).get("matches", ".*")
        name = rule.get("name", {}).get("as") or QUEUE_METRIC
        if re.fullmatch(matches, QUEUE_METRIC):
            exposed = name
        overrides = rule.get("resources", {}).get("overrides", {})
        resources = {o.get("resource") for o in overrides.values()}
        report.check(QUEUE_METRIC in rule.get("seriesQuery", "") and exposed == QUEUE_METRIC
                     and {"pod", "namespace"} <= resources, where,
                     f"a rule finds {QUEUE_METRIC} and exposes it per pod under that name")
    return exposed


def check_invariants(report: Report, where: str, obj: dict, s: Server, objects: list,
                     adapter_metric, base_hpa) -> None:
    kind = obj["kind"]
    if kind == "Deployment":
        check_server(report, where, s, objects)
    elif kind == "Service":
        check_service(report, where, obj, s)
    elif kind == "PodDisruptionBudget":
        check_pdb(report, where, obj, s)
    elif kind == "HorizontalPodAutoscaler":
        check_hpa(report, where, obj, s, adapter_metric)
    elif kind == "PodMonitor":
        check_podmonitor(report, where, obj, s)
    elif kind == "InferencePool":
        check_inferencepool(report, where, obj, s)
    elif kind == "HTTPRoute":
        check_httproute(report, where, obj, objects, s)
    elif kind == "ScaledObject":
        check_scaledobject(report, where, obj, s, objects, base_hpa)


# --- main --------------------------------------------------------------------------------


def kubectl_objects(tree: Path):
    """`kubectl kustomize` of the tree, or None without a kubectl."""
    if not shutil.which("kubectl"):
        return None
    out = subprocess.run(["kubectl", "kustomize", str(tree)], capture_output=True, text=True)
    if out.returncode != 0:
        return out.stderr.strip() or "kubectl kustomize failed"
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None]


def canonical(objects: list) -> list:
    return sorted(json.dumps(o, sort_keys=True) for o in objects)


def main() -> int:
    report = Report(verbose="-v" in sys.argv[1:])
    print(f"kubernetes-validate {version('kubernetes-validate')}, "
          f"jsonschema {version('jsonschema')}, PyYAML {version('PyYAML')}")

    print("\nkustomize trees (tests/kubernetes/render.py)")
    builds, used = {}, {}
    for tree in TREES:
        where = str(tree)
        try:
            build = Build(tree)
        except RenderError as e:
            report.check(False, where, "builds", str(e))
            continue
        builds[tree] = build.objects
        for path in build.files:
            used.setdefault(path, []).append(where)
        report.check(True, where, "builds")
        report.note(where, f"{len(build.objects)} objects from {len(build.files)} files")
        theirs = kubectl_objects(tree)
        if theirs is None:
            report.note(where, "no kubectl here to compare with")
        elif isinstance(theirs, str):
            report.check(False, where, "`kubectl kustomize` builds it too", theirs)
        else:
            report.note(where, "as `kubectl kustomize` builds it")
            report.check(canonical(theirs) == canonical(build.objects), where,
                         "the same objects as `kubectl kustomize`")
    report.flush()

    print("\nfiles under deploy/kubernetes")
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        where = str(path)
        if path in NOT_RESOURCES:
            report.note(where, "not a resource: validated against tests/kubernetes/schemas/"
                        + NOT_RESOURCES[path])
            continue
        report.check(path in used, where, "used by a tree", "listed by no kustomization")
        report.note(where, "in " + ", ".join(used.get(path, [])))
    adapter = {}
    for path, schema in NOT_RESOURCES.items():
        docs = load_documents(path)
        adapter = docs[0] if docs else {}
        errors = schema_errors(load_schema(schema), adapter)
        report.check(not errors, str(path), f"schema {schema}", "; ".join(errors))
    adapter_metric = check_adapter(report, adapter)
    report.flush()

    print("\nobjects: schema, then invariants")
    seen: dict = {}
    base_hpa = named(builds.get(DEPLOY, []), "HorizontalPodAutoscaler", "wasi-nn-host")
    for tree, objects in builds.items():
        deployments = of_kind(objects, "Deployment")
        if len(deployments) != 1:
            report.check(False, str(tree), "one Deployment", f"{len(deployments)} of them")
            report.flush()
            continue
        try:
            s = Server(copy.deepcopy(deployments[0]))
        except (KeyError, IndexError, TypeError) as e:
            report.check(False, str(tree), "a Deployment with a pod template and a container",
                         f"{type(e).__name__}: {e}")
            report.flush()
            continue
        for obj in objects:
            where = f"{tree} {describe(obj)}"
            if not validate_object(report, where, obj, seen):
                report.note(where, "invariants not checked (schema failed)")
                continue
            try:
                check_invariants(report, where, obj, s, objects, adapter_metric, base_hpa)
            except (KeyError, IndexError, TypeError, ValueError) as e:
                report.check(False, where, "invariants", f"{type(e).__name__}: {e}")
        report.flush()

    total = report.passed + report.failed
    print(f"\n{len(builds)} of {len(TREES)} trees built, "
          f"{sum(len(o) for o in builds.values())} objects; Kubernetes schemas "
          f"{', '.join(KUBERNETES_VERSIONS)}; {total} checks, {report.failed} failed"
          + ("" if report.verbose else " (-v lists them all)"))
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
