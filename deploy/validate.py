#!/usr/bin/env python3
"""Checks every manifest under deploy/ offline, and exits non-zero on any fault.

- Renders each kustomization (base, overlays/*, monitoring) with a small
  renderer for the subset of Kustomize these manifests use (resources,
  namespace, images, JSON 6902 patches with a target, `$patch: delete`); any
  other Kustomize feature is an error here, never silently ignored.
- Validates every Kubernetes object with kubernetes-validate --strict against
  a pinned Kubernetes version (unknown fields fail), the Prometheus Operator
  objects against the schemas in deploy/schemas (same strictness), and the
  alert rules with `promtool check rules` and the unit tests in
  monitoring/alerts.test.yaml (`promtool test rules`), and runs the
  relabelling of monitoring/scrape-config.yaml (the scrape job without the
  operator) on the rendered pods.
- Checks what the schemas cannot: terminationGracePeriodSeconds exceeds
  preStop + drain delay + shutdown grace + the server's own flush time in
  every workload, the maximum run duration plus a run's wait for its
  outcome fits in the shutdown grace, each workload names its store
  (SQLite on a persistent volume with one replica, PostgreSQL from a
  Secret), a read-only root has a bounded emptyDir at /tmp, a persistent
  volume is not chowned at every start, every AGENTD_* variable is a flag
  of `agentd serve` (not a client command's), the listen addresses and
  ports (gRPC, admin, A2A), the host the A2A agent card advertises (the
  Service's DNS name), the probes (gRPC startup and readiness, HTTP
  liveness) and, with bearer tokens, an open health service for them, the
  memory limit against the runs in flight and their history, the rollout
  strategy, the headless Service, the PDB, and the Dockerfile's shape.
- With --self-test, breaks the manifests in memory in each of those ways and
  fails unless every break is caught.

Usage: deploy/validate.py [--self-test]   (deploy/requirements.txt installed;
promtool on PATH or in $PROMTOOL)
"""

from __future__ import annotations

import argparse
import copy
import difflib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import dockerfile
import jsonpatch
import jsonschema
import kubernetes_validate
import kubernetes_validate.utils
import yaml

# The Kubernetes version the manifests are validated against. Native gRPC
# probes need 1.27+, the preStop sleep action 1.30+.
KUBERNETES_VERSION = "1.34.0"

DEPLOY = Path(__file__).resolve().parent
ROOT = DEPLOY.parent
KUSTOMIZATIONS = ["base", "overlays/postgres", "overlays/sqlite", "monitoring"]
# Overlays are what gets applied: each must be complete.
OVERLAYS = ["overlays/postgres", "overlays/sqlite"]
PLAIN_FILES = ["examples/secrets.yaml"]
# A Prometheus scrape job for a Prometheus without the operator.
SCRAPE_CONFIG = "monitoring/scrape-config.yaml"

# After SIGTERM: drain delay, then the shutdown grace, then up to 5 s for cut
# runs to record their outcome, 5 s each for the gRPC and the A2A connections
# to close (CUT_FLUSH and CONNECTIONS_CLOSE in src/server.rs) and 5 s for the
# session store to close (STORE_CLOSE_TIMEOUT in src/main.rs).
SERVER_FLUSH_SECONDS = 20

# The service health checkers (the kubelet's gRPC probes) call without
# credentials.
HEALTH_SERVICE = "grpc.health.v1.Health"

CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "schemas/podmonitor.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "schemas/prometheusrule.json",
}
# The agentd container's ports, and the Service's: name -> (port, appProtocol).
# The A2A HTTP face speaks HTTP/1.1; gRPC is HTTP/2 without TLS.
CONTAINER_PORTS = {"grpc": 50051, "admin": 9090, "a2a": 8080}
SERVICE_PORTS = {"grpc": (50051, "kubernetes.io/h2c"), "a2a": (8080, "http")}

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume", "StorageClass"}
WORKLOADS = {"Deployment", "StatefulSet"}


class RenderError(Exception):
    pass


class SourceError(Exception):
    """What this script reads from the Rust sources is not where it expects."""


# --- rendering ---------------------------------------------------------------


def load_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def render(directory: Path) -> list[dict]:
    """The objects `kubectl kustomize directory` would print (for our subset)."""
    kfile = directory / "kustomization.yaml"
    if not kfile.exists():
        raise RenderError(f"{directory}: no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text()) or {}
    supported = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
    unknown = set(k) - supported
    if unknown:
        raise RenderError(f"{kfile}: {sorted(unknown)} not supported by this renderer (supported: {sorted(supported)})")
    docs: list[dict] = []
    for res in k.get("resources", []):
        p = (directory / res).resolve()
        docs += render(p) if p.is_dir() else load_docs(p)
    for patch in k.get("patches", []):
        docs = apply_patch(directory, docs, patch)
    for image in k.get("images", []):
        set_image(docs, image)
    if "namespace" in k:
        for d in docs:
            if d.get("kind") not in CLUSTER_SCOPED:
                d.setdefault("metadata", {})["namespace"] = k["namespace"]
    seen = set()
    for d in docs:
        key = (d.get("apiVersion"), d.get("kind"), d.get("metadata", {}).get("namespace"), d.get("metadata", {}).get("name"))
        if key in seen:
            raise RenderError(f"{directory}: {key[1]} {key[3]} is defined twice")
        seen.add(key)
    return docs


def matches(doc: dict, target: dict) -> bool:
    supported = {"kind", "name", "namespace"}
    if set(target) - supported:
        raise RenderError(f"patch target keys {sorted(set(target) - supported)} not supported (use {sorted(supported)})")
    md = doc.get("metadata", {})
    return all(
        [
            target.get("kind") in (None, doc.get("kind")),
            target.get("name") in (None, md.get("name")),
            target.get("namespace") in (None, md.get("namespace")),
        ]
    )


def apply_patch(directory: Path, docs: list[dict], entry: dict) -> list[dict]:
    if set(entry) - {"path", "patch", "target"}:
        raise RenderError(f"{directory}: patch keys {sorted(set(entry) - {'path', 'patch', 'target'})} not supported")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    body = yaml.safe_load(text)
    if isinstance(body, list):
        if "target" not in entry:
            raise RenderError(f"{directory}: a JSON 6902 patch needs a target")
        hits = [i for i, d in enumerate(docs) if matches(d, entry["target"])]
        if not hits:
            raise RenderError(f"{directory}: patch target {entry['target']} matches nothing")
        for i in hits:
            docs[i] = jsonpatch.apply_patch(docs[i], body)
        return docs
    if isinstance(body, dict) and body.get("$patch") == "delete":
        target = {"kind": body.get("kind"), "name": body.get("metadata", {}).get("name")}
        kept = [d for d in docs if not matches(d, target)]
        if len(kept) != len(docs) - 1:
            raise RenderError(f"{directory}: $patch: delete of {target} must remove exactly one object")
        return kept
    raise RenderError(f"{directory}: only JSON 6902 patches and `$patch: delete` are supported by this renderer")


def pod_spec(doc: dict) -> dict | None:
    if doc.get("kind") in WORKLOADS:
        return doc.get("spec", {}).get("template", {}).get("spec")
    return None


def set_image(docs: list[dict], image: dict) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise RenderError(f"images: keys {sorted(set(image) - {'name', 'newName', 'newTag'})} not supported")
    for d in docs:
        spec = pod_spec(d)
        for c in (spec or {}).get("containers", []) + (spec or {}).get("initContainers", []):
            name, _, tag = c.get("image", "").partition(":")
            if name == image["name"]:
                c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


# --- schemas -------------------------------------------------------------------


def schema_errors(doc: dict) -> list[str]:
    what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    crd = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
    if crd:
        schema = json.loads((DEPLOY / crd).read_text())
        v = jsonschema.Draft7Validator(schema)
        return [f"{what}: {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in v.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"{what}: no schema for {doc.get('apiVersion')} {doc.get('kind')} (add one to deploy/schemas)"]
    except kubernetes_validate.ValidationError as e:
        return [f"{what}: {'/'.join(map(str, e.path)) or '(top)'}: {e.message}"]
    return []


# --- what the schemas cannot check ---------------------------------------------


def duration_seconds(s: str) -> float:
    """humantime-style durations as the binary takes them: 500ms, 30s, 2m, 1h30m."""
    units = {"ms": 0.001, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "days": 86400}
    parts = re.findall(r"(\d+)\s*([a-z]+)", s.strip())
    if not parts or "".join(n + u for n, u in parts) != re.sub(r"\s+", "", s.strip()):
        raise ValueError(f"not a duration: {s!r}")
    return sum(int(n) * units[u] for n, u in parts)


@functools.cache
def outcome_wait_seconds() -> float:
    """How long a run may hold its stream past its deadline while its outcome
    is stored (OUTCOME_WAIT in src/turn/pump.rs): a run lasts up to the
    maximum run duration plus this, which the shutdown grace must cover."""
    m = re.search(r"const OUTCOME_WAIT: Duration = Duration::from_secs\((\d+)\);", (ROOT / "src/turn/pump.rs").read_text())
    if not m:
        raise SourceError("src/turn/pump.rs: no `const OUTCOME_WAIT: Duration = Duration::from_secs(N);` (update outcome_wait_seconds)")
    return float(m.group(1))


def arg_flags(text: str, global_only: bool = False) -> dict[str, str | None]:
    """The AGENTD_* variables of the #[arg(...)] attributes in `text` (only
    those with `global = true` if `global_only`), with their defaults (a
    string default_value, or an integer default_value_t)."""
    flags: dict[str, str | None] = {}
    for attr in re.findall(r"#\[arg\((.*?)\)\]", text, re.S):
        env = re.search(r'env\s*=\s*"(AGENTD_[A-Z0-9_]+)"', attr)
        if env and (not global_only or re.search(r"\bglobal\s*=\s*true\b", attr)):
            default = re.search(r'default_value\s*=\s*"([^"]*)"', attr)
            number = re.search(r"default_value_t\s*=\s*([0-9_][0-9_\s*+]*)(?=[,)]|$)", attr.strip())
            if default:
                flags[env.group(1)] = default.group(1)
            elif number:
                flags[env.group(1)] = str(eval(number.group(1), {"__builtins__": {}}))  # digits, _, * and + only
            else:
                flags[env.group(1)] = None
    return flags


@functools.cache
def config_source() -> str:
    return (ROOT / "src/config.rs").read_text()


def known_flags() -> dict[str, str | None]:
    """The AGENTD_* variables `agentd serve` reads, with their defaults: the
    fields of ServeArgs in src/config.rs, the global flags (`global = true`),
    and AGENTD_LOG, which src/telemetry.rs reads. The client commands'
    variables (AGENTD_SERVER, AGENTD_TOKEN, AGENTD_TLS_CA, ...) are not
    among them: on the server's workload they would be ignored."""
    text = config_source()
    m = re.search(r"^pub struct ServeArgs \{\n(.*?)^\}", text, re.S | re.M)
    if not m:
        raise SourceError("src/config.rs: no `pub struct ServeArgs { ... }` (update known_flags)")
    if "flatten" in m.group(1):
        raise SourceError("src/config.rs: ServeArgs flattens another struct, whose flags known_flags does not read (teach it to)")
    flags: dict[str, str | None] = {}
    if '"AGENTD_LOG"' in (ROOT / "src/telemetry.rs").read_text():
        flags["AGENTD_LOG"] = None
    flags |= arg_flags(text, global_only=True)
    flags |= arg_flags(m.group(1))
    return flags


def unknown_flag(name: str, flags: dict[str, str | None]) -> str:
    """Why `name` is not one of `flags` (serve's), for its error."""
    if name in arg_flags(config_source()):
        # A client's variable is mistaken for the server's of the same
        # family (AGENTD_TLS_CA for AGENTD_TLS_CLIENT_CA): name the family.
        family = "_".join(name.split("_")[:2]) + "_"
        kin = sorted(f for f in flags if f.startswith(family))
        hint = f" (serve's {family}* variables: {', '.join(kin)})" if kin else ""
        return f"{name} is a flag of agentd's client commands, not of agentd serve: the server would ignore it{hint}"
    near = difflib.get_close_matches(name, list(flags), n=1, cutoff=0.75)
    hint = f" (did you mean {near[0]}?)" if near else ""
    return f"{name} is not a flag of agentd serve (src/config.rs): the server would ignore it{hint}"


def quantity_bytes(q: str | int) -> float:
    """A Kubernetes memory quantity (512Mi, 1G, 1e9, 1073741824) in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(?:([KMGTPE]i|[kMGTPE]|m)|[eE](-?\d+))?", str(q).strip())
    if not m:
        raise ValueError(f"not a quantity: {q!r}")
    number, suffix, exponent = m.groups()
    factors = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    factors |= {f"{p}i": 1024 ** (i + 1) for i, p in enumerate("KMGTPE")}
    return float(number) * (factors[suffix] if suffix else 10 ** int(exponent or 0))


def effective_env(container: dict, docs: list[dict], errors: list[str], what: str) -> dict[str, str | None]:
    """The container's variables: envFrom ConfigMaps, then env (env wins). A
    value from a Secret or a field is None."""
    env: dict[str, str | None] = {}
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d.get("kind") == "ConfigMap"}
    for src in container.get("envFrom", []):
        ref = src.get("configMapRef")
        if ref:
            if ref["name"] not in configmaps:
                if not ref.get("optional"):
                    errors.append(f"{what}: envFrom ConfigMap {ref['name']} is not in the rendered set")
                continue
            env.update(configmaps[ref["name"]])
    for e in container.get("env", []):
        env[e["name"]] = e.get("value") if "valueFrom" not in e else None
    return env


def expanded_env(container: dict, docs: list[dict], namespace: str | None) -> dict[str, str | None]:
    """The container's variables as the kubelet sets them: envFrom ConfigMaps,
    then env in order, each `$(NAME)` replaced when NAME was defined before it
    (as Kubernetes does; an unknown one stays as written). A field reference
    to metadata.namespace is `namespace`; other Secret or field values are None."""
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d.get("kind") == "ConfigMap"}
    env: dict[str, str | None] = {}
    for src in container.get("envFrom", []):
        env.update(configmaps.get(src.get("configMapRef", {}).get("name"), {}))
    for e in container.get("env", []):
        if "valueFrom" in e:
            field = e["valueFrom"].get("fieldRef", {}).get("fieldPath")
            env[e["name"]] = namespace if field == "metadata.namespace" else None
            continue
        known = dict(env)
        env[e["name"]] = re.sub(
            r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
            lambda m: known[m.group(1)] if known.get(m.group(1)) is not None else m.group(0),
            e.get("value", ""),
        )
    return env


def check_workload(doc: dict, docs: list[dict], flags: dict[str, str | None]) -> list[str]:
    what = f"{doc['kind']}/{doc['metadata']['name']}"
    errors: list[str] = []
    spec = pod_spec(doc) or {}
    containers = [c for c in spec.get("containers", []) if c.get("name") == "agentd"]
    if len(containers) != 1:
        return [f"{what}: expected one container named agentd"]
    c = containers[0]
    env = effective_env(c, docs, errors, what)

    for name in env:
        if name.startswith("AGENTD_") and name not in flags:
            errors.append(f"{what}: {unknown_flag(name, flags)}")

    def setting(name: str) -> float:
        value = env.get(name, flags.get(name))
        if value is None:
            errors.append(f"{what}: {name} has no value and no default")
            return 0.0
        try:
            return duration_seconds(value)
        except ValueError as e:
            errors.append(f"{what}: {name}: {e}")
            return 0.0

    drain, grace, max_run = setting("AGENTD_DRAIN_DELAY"), setting("AGENTD_SHUTDOWN_GRACE"), setting("AGENTD_MAX_RUN_DURATION")
    pre_stop = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre_stop:
        pre = float(pre_stop["sleep"]["seconds"])
    elif pre_stop:
        errors.append(f"{what}: preStop must be a sleep action (its length enters the grace arithmetic)")
        pre = 0.0
    else:
        errors.append(f"{what}: no preStop: endpoints may still send calls after SIGTERM")
        pre = 0.0
    tgps = spec.get("terminationGracePeriodSeconds", 30)
    needed = pre + drain + grace + SERVER_FLUSH_SECONDS
    if not tgps > needed:
        errors.append(
            f"{what}: terminationGracePeriodSeconds {tgps} must exceed preStop {pre:g}s + drain delay {drain:g}s"
            f" + shutdown grace {grace:g}s + {SERVER_FLUSH_SECONDS}s = {needed:g}s, or the kubelet kills runs the drain promised"
        )
    wait = outcome_wait_seconds()
    if not max_run + wait <= grace:
        errors.append(
            f"{what}: AGENTD_MAX_RUN_DURATION ({max_run:g}s) + {wait:g}s (a run's wait past it for its outcome to be stored)"
            f" = {max_run + wait:g}s must be at most AGENTD_SHUTDOWN_GRACE ({grace:g}s), or a run that reaches its bound during a drain"
            f" may be cut before its outcome is stored (the server refuses to start when the bound alone reaches the grace, and warns short of that)"
        )

    for name, want in [("AGENTD_LISTEN", "[::]:50051"), ("AGENTD_ADMIN_LISTEN", "[::]:9090"), ("AGENTD_A2A_LISTEN", "[::]:8080")]:
        if env.get(name) != want:
            errors.append(f"{what}: {name} must be {want} in a container (is {env.get(name)!r})")

    # The binary's default store is a file in the working directory, on a
    # read-only root file system: every workload names its store.
    if "AGENTD_STORE" not in env:
        errors.append(f"{what}: AGENTD_STORE is not set (the default SQLite file would be on the read-only root file system)")
    store = env.get("AGENTD_STORE") or ""
    if store.startswith("sqlite://"):
        directory = str(Path(store[len("sqlite://"):]).parent)
        # A claim of the StatefulSet's or a PersistentVolumeClaim volume: an
        # emptyDir (/tmp) goes with the pod.
        persistent = {t.get("metadata", {}).get("name") for t in doc["spec"].get("volumeClaimTemplates", [])}
        persistent |= {v.get("name") for v in spec.get("volumes", []) if "persistentVolumeClaim" in v}
        mounts = {m.get("mountPath"): m.get("name") for m in c.get("volumeMounts", [])}
        if mounts.get(directory) not in persistent:
            errors.append(f"{what}: the SQLite file {store} must be on a persistent volume (persistent mounts: {sorted(p for p, n in mounts.items() if n in persistent)})")
        if doc["spec"].get("replicas", 1) != 1:
            errors.append(f"{what}: a SQLite store serves exactly one replica")
    if store.startswith("postgres"):
        errors.append(f"{what}: a PostgreSQL URL carries a password: take AGENTD_STORE from a Secret")

    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports", [])}
    if ports != CONTAINER_PORTS:
        errors.append(f"{what}: container ports must be {CONTAINER_PORTS} (are {ports})")
    for probe in ["startupProbe", "readinessProbe"]:
        grpc = c.get(probe, {}).get("grpc")
        if not grpc or grpc.get("port") != 50051:
            errors.append(f"{what}: {probe} must be a gRPC probe (grpc.health.v1) on port 50051")
    # gRPC health turns NOT_SERVING while the store is away: as liveness it
    # would restart every pod during a database outage.
    live = c.get("livenessProbe", {}).get("httpGet", {})
    if live.get("path") != "/healthz" or live.get("port") not in (9090, "admin"):
        errors.append(f"{what}: livenessProbe must be an HTTP GET of /healthz on the admin port 9090")
    # With bearer tokens every call needs one unless its service is open;
    # the kubelet's gRPC probes send none, so the health service must be
    # open or the pod never turns ready (the server only warns).
    if "AGENTD_AUTH_TOKENS" in env and any("grpc" in c.get(p, {}) for p in ["startupProbe", "readinessProbe", "livenessProbe"]):
        value = env.get("AGENTD_AUTH_OPEN_SERVICES", flags.get("AGENTD_AUTH_OPEN_SERVICES"))
        if value is None:
            errors.append(f"{what}: AGENTD_AUTH_OPEN_SERVICES must be a plain value (the gRPC probes need {HEALTH_SERVICE} in it)")
        elif HEALTH_SERVICE not in [s.strip() for s in value.split(",")]:
            errors.append(
                f"{what}: AGENTD_AUTH_OPEN_SERVICES ({value!r}) must name {HEALTH_SERVICE} with AGENTD_AUTH_TOKENS set and gRPC probes:"
                " the kubelet's probes carry no token, get UNAUTHENTICATED, and the pod never turns ready"
            )
    resources = c.get("resources", {})
    for kind in ["requests", "limits"]:
        if not {"cpu", "memory"} <= set(resources.get(kind, {})):
            errors.append(f"{what}: resources.{kind} must set cpu and memory")
    # Each run in flight holds its session's history (up to
    # AGENTD_HISTORY_BYTES): at the run cap, that must leave the other half
    # of the limit to the process, its buffers and connections, or a busy
    # pod is OOM-killed with every run on it.
    def count(name: str) -> int | None:
        value = env.get(name, flags.get(name))
        try:
            return int(value) if value is not None else None
        except ValueError:
            errors.append(f"{what}: {name}: not a number: {value!r}")
            return None

    runs, history = count("AGENTD_MAX_CONCURRENT_RUNS"), count("AGENTD_HISTORY_BYTES")
    memory = resources.get("limits", {}).get("memory")
    if runs is None or history is None:
        errors.append(f"{what}: AGENTD_MAX_CONCURRENT_RUNS and AGENTD_HISTORY_BYTES need plain values (the memory limit is checked against them)")
    elif memory is not None:
        try:
            limit = quantity_bytes(memory)
        except ValueError as e:
            errors.append(f"{what}: resources.limits.memory: {e}")
        else:
            if runs * history > limit / 2:
                mib = 1024 * 1024
                errors.append(
                    f"{what}: AGENTD_MAX_CONCURRENT_RUNS ({runs}) x AGENTD_HISTORY_BYTES ({history}) = {runs * history / mib:g} MiB of history"
                    f" must be at most half of limits.memory {memory} ({limit / 2 / mib:g} MiB): lower either, or raise the limit"
                )
    if not spec.get("securityContext", {}).get("runAsNonRoot"):
        errors.append(f"{what}: the pod must run as non-root (securityContext.runAsNonRoot)")
    # A read-only root leaves nowhere for temporary files (SQLite's sorts
    # that spill, an index a migration builds) unless /tmp is a volume.
    if c.get("securityContext", {}).get("readOnlyRootFilesystem"):
        tmp = next((m for m in c.get("volumeMounts", []) if m.get("mountPath") == "/tmp"), None)
        volumes = {v.get("name"): v for v in spec.get("volumes", [])}
        if tmp is None or tmp.get("readOnly"):
            errors.append(f"{what}: a read-only root file system needs a writable /tmp (an emptyDir mounted there) for temporary files")
        elif "sizeLimit" not in (volumes.get(tmp.get("name"), {}).get("emptyDir") or {}):
            errors.append(f"{what}: /tmp must be an emptyDir with a sizeLimit (unbounded, it could fill the node's disk)")
    # fsGroup with the default policy chowns every file of the volume at
    # every start: minutes for a large one, before the container starts.
    pod_security = spec.get("securityContext", {})
    if doc["spec"].get("volumeClaimTemplates") and "fsGroup" in pod_security and pod_security.get("fsGroupChangePolicy") != "OnRootMismatch":
        errors.append(f"{what}: with fsGroup on a persistent volume, securityContext.fsGroupChangePolicy must be OnRootMismatch (Always chowns the whole volume at every start)")

    if doc["kind"] == "Deployment":
        rolling = doc["spec"].get("strategy", {}).get("rollingUpdate", {})
        if doc["spec"].get("strategy", {}).get("type", "RollingUpdate") != "RollingUpdate" or str(rolling.get("maxUnavailable")) not in ("0", "0%"):
            errors.append(f"{what}: the rollout must be RollingUpdate with maxUnavailable 0 (capacity never drops)")
    return errors


def check_overlay(name: str, docs: list[dict], flags: dict[str, str | None]) -> list[str]:
    errors: list[str] = []
    workloads = [d for d in docs if d.get("kind") in WORKLOADS]
    if len(workloads) != 1:
        errors.append(f"{name}: expected exactly one workload, found {[d['kind'] for d in workloads]}")
    for w in workloads:
        errors += [f"{name}: {e}" for e in check_workload(w, docs, flags)]
    services = [d for d in docs if d.get("kind") == "Service"]
    if len(services) != 1:
        errors.append(f"{name}: expected one Service")
    for s in services:
        if s["spec"].get("clusterIP") != "None":
            errors.append(f"{name}: Service/{s['metadata']['name']} must be headless (clusterIP: None) for per-call balancing")
        ports = {p.get("name"): p for p in s["spec"].get("ports", [])}
        if set(ports) != set(SERVICE_PORTS):
            errors.append(f"{name}: Service/{s['metadata']['name']} must have the ports {sorted(SERVICE_PORTS)} (has {sorted(ports)})")
        for port_name, (number, protocol) in SERVICE_PORTS.items():
            p = ports.get(port_name)
            if p is None:
                continue
            if p.get("port") != number or p.get("targetPort") != port_name:
                errors.append(f"{name}: Service port {port_name} must be {number} with targetPort {port_name}")
            if p.get("appProtocol") != protocol:
                errors.append(f"{name}: Service port {port_name} must declare appProtocol {protocol}")
    # The agent card must name an address A2A clients can reach: the
    # Service's DNS name in the pod's namespace (a pod's own host name is
    # not in DNS).
    for w in workloads:
        ns = w["metadata"].get("namespace")
        for s in services:
            want = f"{s['metadata']['name']}.{ns}.svc.cluster.local"
            for c in (pod_spec(w) or {}).get("containers", []):
                if c.get("name") != "agentd":
                    continue
                host = expanded_env(c, docs, ns).get("AGENTD_A2A_ADVERTISE_HOST")
                if host != want:
                    errors.append(f"{name}: AGENTD_A2A_ADVERTISE_HOST must expand to {want}, the Service's name (is {host!r})")
    for w in workloads:
        labels = w["spec"]["template"]["metadata"].get("labels", {})
        pdbs = [
            d for d in docs
            if d.get("kind") == "PodDisruptionBudget"
            and d["spec"].get("selector", {}).get("matchLabels", {}).items() <= labels.items()
        ]
        if not pdbs:
            errors.append(f"{name}: no PodDisruptionBudget selects {w['kind']}/{w['metadata']['name']}")
        if w["kind"] == "StatefulSet" and w["spec"].get("serviceName") not in {s["metadata"]["name"] for s in services}:
            errors.append(f"{name}: the StatefulSet's serviceName must be the headless Service")
    return errors


def promtool() -> str | None:
    return os.environ.get("PROMTOOL") or shutil.which("promtool")


def check_rules(docs: list[dict]) -> list[str]:
    """promtool check rules and promtool test rules on every PrometheusRule."""
    rules = [d for d in docs if d.get("kind") == "PrometheusRule"]
    if not rules:
        return ["monitoring: no PrometheusRule"]
    tool = promtool()
    if not tool:
        return ["promtool not found (set PROMTOOL or put it on PATH; .ci/setup.d/deploy-manifests.sh installs it)"]
    errors: list[str] = []
    for r in rules:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "rules.yaml").write_text(yaml.safe_dump(r["spec"]))
            shutil.copy(DEPLOY / "monitoring/alerts.test.yaml", Path(tmp) / "alerts.test.yaml")
            for args in (["check", "rules", "rules.yaml"], ["test", "rules", "alerts.test.yaml"]):
                p = subprocess.run([tool, *args], cwd=tmp, capture_output=True, text=True)
                if p.returncode != 0:
                    errors.append(f"PrometheusRule/{r['metadata']['name']}: promtool {' '.join(args[:2])} failed:\n{p.stdout}{p.stderr}")
    return errors


def relabel(labels: dict[str, str], rules: list[dict]) -> dict[str, str] | None:
    """Prometheus's relabelling of one target, for the actions the scrape
    config uses (replace, keep, drop); None when the target is dropped."""
    fields = {"source_labels", "separator", "regex", "target_label", "replacement", "action"}
    for r in rules:
        action = r.get("action", "replace")
        if set(r) - fields or action not in ("replace", "keep", "drop"):
            raise ValueError(f"relabel rule {r}: only replace, keep and drop with {sorted(fields)} are simulated here")
        value = r.get("separator", ";").join(labels.get(name, "") for name in r.get("source_labels", []))
        m = re.fullmatch(str(r.get("regex", "(.*)")), value)
        if action == "keep" and not m or action == "drop" and m:
            return None
        if action == "replace" and m:
            new = re.sub(r"\$\{?(\d+)\}?", lambda g: m.group(int(g.group(1))) or "", r.get("replacement", "$1"))
            if new:
                labels[r["target_label"]] = new
            else:
                labels.pop(r["target_label"], None)
    return labels


def pod_targets(namespace: str, name: str, template: dict) -> list[dict[str, str]]:
    """The targets Kubernetes pod discovery makes of a pod: one per container
    port, with its __meta_kubernetes_* labels."""
    def clean(k: str) -> str:
        return re.sub(r"[^a-zA-Z0-9_]", "_", k)

    meta = {"__meta_kubernetes_namespace": namespace, "__meta_kubernetes_pod_name": name}
    meta |= {f"__meta_kubernetes_pod_label_{clean(k)}": str(v) for k, v in template["metadata"].get("labels", {}).items()}
    meta |= {f"__meta_kubernetes_pod_annotation_{clean(k)}": str(v) for k, v in template["metadata"].get("annotations", {}).items()}
    return [
        meta | {
            "__address__": f"10.0.0.7:{p['containerPort']}",
            "__meta_kubernetes_pod_container_name": c["name"],
            "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
            "__meta_kubernetes_pod_container_port_number": str(p["containerPort"]),
        }
        for c in template["spec"]["containers"]
        for p in c.get("ports", [])
    ]


def scraped(job: dict, target: dict[str, str]) -> dict[str, str] | None:
    labels = relabel({"job": job.get("job_name", ""), "__metrics_path__": job.get("metrics_path", "/metrics")} | target, job.get("relabel_configs", []))
    if labels is not None:
        labels.setdefault("instance", labels["__address__"])
    return labels


def check_scrape_config(config: dict, rendered: dict[str, list[dict]]) -> list[str]:
    """monitoring/scrape-config.yaml, run on the rendered pods: each agentd pod
    is scraped once, on its admin port and path, with the labels the alert
    rules need (job="agentd", namespace, pod); another annotated pod is not."""
    what = SCRAPE_CONFIG
    jobs = config.get("scrape_configs", [])
    if len(jobs) != 1:
        return [f"{what}: expected one scrape job"]
    job = jobs[0]
    errors: list[str] = []
    if job.get("job_name") != "agentd":
        errors.append(f"{what}: job_name must be agentd (is {job.get('job_name')!r}): the alert rules select job=\"agentd\"")
    try:
        for name in OVERLAYS:
            for w in (d for d in rendered[name] if d.get("kind") in WORKLOADS):
                ns, pod = w["metadata"].get("namespace", "default"), f"{w['metadata']['name']}-0"
                template = w["spec"]["template"]
                kept = [t for t in (scraped(job, t) for t in pod_targets(ns, pod, template)) if t is not None]
                if len(kept) != 1:
                    errors.append(f"{what}: {name}: a pod must be one target, not {len(kept)}")
                    continue
                t = kept[0]
                annotations = template["metadata"].get("annotations", {})
                if annotations.get("prometheus.io/port") != str(CONTAINER_PORTS["admin"]):
                    errors.append(f"{what}: {name}: the annotation prometheus.io/port must name the admin port {CONTAINER_PORTS['admin']}")
                path = annotations.get("prometheus.io/path", "/metrics")
                if not t["__address__"].endswith(f":{CONTAINER_PORTS['admin']}") or t["__metrics_path__"] != path:
                    errors.append(f"{what}: {name}: must scrape the admin port {CONTAINER_PORTS['admin']} at {path} (scrapes {t['__address__']}{t['__metrics_path__']})")
                for label, want in [("job", "agentd"), ("namespace", ns), ("pod", pod)]:
                    if t.get(label) != want:
                        errors.append(f"{what}: {name}: the series need {label}={want!r} (the alert rules select or group by it), get {t.get(label)!r}")
        other = {"metadata": {"labels": {"app.kubernetes.io/name": "other"}, "annotations": {"prometheus.io/scrape": "true"}},
                 "spec": {"containers": [{"name": "other", "ports": [{"name": "admin", "containerPort": 9090}]}]}}
        if any(scraped(job, t) is not None for t in pod_targets("agentd", "other-0", other)):
            errors.append(f"{what}: scrapes pods that are not agentd's")
    except (ValueError, KeyError, re.error) as e:
        errors.append(f"{what}: {e}")
    return errors


def check_dockerfile(path: Path) -> list[str]:
    try:
        cmds = dockerfile.parse_file(str(path))
    except dockerfile.GoParseError as e:
        return [f"{path.name}: {e}"]
    errors: list[str] = []
    stages = [i for i, c in enumerate(cmds) if c.cmd == "FROM"]
    if len(stages) < 2:
        errors.append(f"{path.name}: must be multi-stage (a build stage and a runtime stage)")
    final = cmds[stages[-1]:] if stages else cmds
    users = [c.value[0] for c in final if c.cmd == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        errors.append(f"{path.name}: the runtime stage must end with a non-root USER")
    if not any(c.cmd == "ENTRYPOINT" for c in final):
        errors.append(f"{path.name}: the runtime stage needs an ENTRYPOINT")
    if not any(c.cmd == "RUN" and "cargo build --release --locked" in " ".join(c.value) for c in cmds):
        errors.append(f"{path.name}: the build must be `cargo build --release --locked`")
    if not any(c.cmd == "COPY" and "--from=build" in c.flags for c in final):
        errors.append(f"{path.name}: the runtime stage must copy the binary from the build stage")
    return errors


# --- driver ----------------------------------------------------------------------


def validate(rendered: dict[str, list[dict]], plain: dict[str, list[dict]], dockerfile_path: Path, scrape: dict | None = None) -> list[str]:
    errors: list[str] = []
    errors += check_scrape_config(scrape if scrape is not None else yaml.safe_load((DEPLOY / SCRAPE_CONFIG).read_text()), rendered)
    flags = known_flags()
    for name, docs in {**rendered, **plain}.items():
        for d in docs:
            errors += [f"{name}: {e}" for e in schema_errors(d)]
    for name in OVERLAYS:
        errors += check_overlay(name, rendered[name], flags)
    errors += check_rules(rendered["monitoring"])
    errors += check_dockerfile(dockerfile_path)
    return errors


def render_all() -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    rendered = {k: render(DEPLOY / k) for k in KUSTOMIZATIONS}
    plain = {f: load_docs(DEPLOY / f) for f in PLAIN_FILES}
    return rendered, plain


def self_test(rendered: dict[str, list[dict]], plain: dict[str, list[dict]]) -> list[str]:
    """Each break must be caught; returns the breaks that were not."""

    def find(docs: list[dict], kind: str) -> dict:
        return next(d for d in docs if d.get("kind") == kind)

    def container(docs: list[dict], kind: str = "Deployment") -> dict:
        return find(docs, kind)["spec"]["template"]["spec"]["containers"][0]

    def env(docs: list[dict], name: str, value: str, kind: str = "Deployment") -> None:
        for e in container(docs, kind)["env"]:
            if e["name"] == name:
                e["value"] = value

    pg, sq, mon = "overlays/postgres", "overlays/sqlite", "monitoring"
    # (what, where, the error it must cause, how to break it)
    breaks: list[tuple[str, str, str, Callable[[list[dict]], None]]] = [
        ("an unknown field in a Deployment", pg, "'replicaz' was unexpected", lambda d: find(d, "Deployment")["spec"].update(replicaz=3)),
        ("an unknown field in a container", sq, "'imagePullPolice' was unexpected", lambda d: container(d, "StatefulSet").update(imagePullPolice="Always")),
        ("a wrong type", pg, "replicas: 'three' is not of type 'integer'", lambda d: find(d, "Deployment")["spec"].update(replicas="three")),
        ("an unknown field in a PodMonitor", mon, "'podMetricEndpoints' was unexpected", lambda d: find(d, "PodMonitor")["spec"].update(podMetricEndpoints=[])),
        ("an unknown field in an alert rule", mon, "'fro' was unexpected", lambda d: find(d, "PrometheusRule")["spec"]["groups"][1]["rules"][0].update(fro="5m")),
        ("a grace period too short for the drain", pg, "terminationGracePeriodSeconds 160 must exceed", lambda d: find(d, "Deployment")["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=160)),
        ("a longer shutdown grace without a longer grace period", sq, "shutdown grace 180s", lambda d: env(d, "AGENTD_SHUTDOWN_GRACE", "3m", "StatefulSet")),
        ("a run longer than the shutdown grace", pg, "AGENTD_MAX_RUN_DURATION (600s) + 5s", lambda d: env(d, "AGENTD_MAX_RUN_DURATION", "10m")),
        ("a run bound without room for its outcome", sq, "AGENTD_MAX_RUN_DURATION (128s) + 5s (a run's wait past it for its outcome to be stored) = 133s must be at most AGENTD_SHUTDOWN_GRACE (130s)", lambda d: env(d, "AGENTD_MAX_RUN_DURATION", "128s", "StatefulSet")),
        ("a misspelt AGENTD_ variable", pg, "AGENTD_DRAIN_DELEY is not a flag of agentd serve (src/config.rs): the server would ignore it (did you mean AGENTD_DRAIN_DELAY?)", lambda d: find(d, "ConfigMap")["data"].update(AGENTD_DRAIN_DELEY="5s")),
        ("a client command's variable on the server", pg, "AGENTD_TLS_CA is a flag of agentd's client commands, not of agentd serve: the server would ignore it (serve's AGENTD_TLS_* variables: AGENTD_TLS_CERT, AGENTD_TLS_CLIENT_CA, AGENTD_TLS_KEY)", lambda d: find(d, "ConfigMap")["data"].update(AGENTD_TLS_CA="/etc/agentd/tls/ca.pem")),
        ("the health service closed to tokenless probes", sq, "AGENTD_AUTH_OPEN_SERVICES ('') must name grpc.health.v1.Health", lambda d: container(d, "StatefulSet")["env"].append({"name": "AGENTD_AUTH_OPEN_SERVICES", "value": ""})),
        ("only reflection open to tokenless probes", pg, "AGENTD_AUTH_OPEN_SERVICES ('grpc.reflection.v1.ServerReflection') must name", lambda d: find(d, "ConfigMap")["data"].update(AGENTD_AUTH_OPEN_SERVICES="grpc.reflection.v1.ServerReflection")),
        ("the binary's default history at the shipped run cap", pg, "AGENTD_HISTORY_BYTES (1048576) = 1024 MiB of history must be at most half of limits.memory 512Mi (256 MiB)", lambda d: find(d, "ConfigMap")["data"].pop("AGENTD_HISTORY_BYTES")),
        ("a memory limit too small for the runs' history", sq, "must be at most half of limits.memory 256Mi", lambda d: container(d, "StatefulSet")["resources"]["limits"].update(memory="256Mi")),
        ("the gRPC port on loopback", pg, "AGENTD_LISTEN must be [::]:50051", lambda d: env(d, "AGENTD_LISTEN", "127.0.0.1:50051")),
        ("a liveness probe on gRPC health", sq, "livenessProbe must be an HTTP GET of /healthz", lambda d: container(d, "StatefulSet").update(livenessProbe={"grpc": {"port": 50051}})),
        ("an HTTP readiness probe", pg, "readinessProbe must be a gRPC probe", lambda d: container(d).update(readinessProbe={"httpGet": {"path": "/readyz", "port": 9090}})),
        ("a rollout that may drop capacity", pg, "maxUnavailable 0", lambda d: find(d, "Deployment")["spec"]["strategy"]["rollingUpdate"].update(maxUnavailable=1)),
        ("a Service with a cluster IP", sq, "must be headless", lambda d: find(d, "Service")["spec"].pop("clusterIP")),
        ("a Service port without h2c", pg, "appProtocol kubernetes.io/h2c", lambda d: find(d, "Service")["spec"]["ports"][0].pop("appProtocol")),
        ("the A2A port on loopback", sq, "AGENTD_A2A_LISTEN must be [::]:8080", lambda d: env(d, "AGENTD_A2A_LISTEN", "127.0.0.1:8080", "StatefulSet")),
        ("no A2A container port", pg, "container ports must be", lambda d: container(d)["ports"].pop()),
        ("a Service without the A2A port", pg, "must have the ports ['a2a', 'grpc']", lambda d: find(d, "Service")["spec"]["ports"].pop()),
        ("the pod's host name on the agent card", sq, "AGENTD_A2A_ADVERTISE_HOST must expand to agentd.agentd.svc.cluster.local", lambda d: container(d, "StatefulSet")["env"].pop(next(i for i, e in enumerate(container(d, "StatefulSet")["env"]) if e["name"] == "AGENTD_A2A_ADVERTISE_HOST"))),
        ("the namespace defined after its use", pg, "(is 'agentd.$(POD_NAMESPACE).svc.cluster.local')", lambda d: container(d)["env"].append(container(d)["env"].pop(next(i for i, e in enumerate(container(d)["env"]) if e["name"] == "POD_NAMESPACE")))),
        ("no store named", pg, "AGENTD_STORE is not set", lambda d: container(d)["env"].pop(next(i for i, e in enumerate(container(d)["env"]) if e["name"] == "AGENTD_STORE"))),
        ("SQLite off its volume", sq, "must be on a persistent volume", lambda d: env(d, "AGENTD_STORE", "sqlite:///tmp/agentd.db", "StatefulSet")),
        ("SQLite with two replicas", sq, "exactly one replica", lambda d: find(d, "StatefulSet")["spec"].update(replicas=2)),
        ("no writable /tmp on a read-only root", sq, "needs a writable /tmp", lambda d: container(d, "StatefulSet")["volumeMounts"].pop(next(i for i, m in enumerate(container(d, "StatefulSet")["volumeMounts"]) if m["mountPath"] == "/tmp"))),
        ("an unbounded /tmp", pg, "/tmp must be an emptyDir with a sizeLimit", lambda d: next(v for v in find(d, "Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "tmp")["emptyDir"].pop("sizeLimit")),
        ("a volume chowned at every start", sq, "fsGroupChangePolicy must be OnRootMismatch", lambda d: find(d, "StatefulSet")["spec"]["template"]["spec"]["securityContext"].pop("fsGroupChangePolicy")),
        ("no PodDisruptionBudget", pg, "no PodDisruptionBudget", lambda d: d.remove(find(d, "PodDisruptionBudget"))),
        ("broken PromQL", mon, "promtool check rules failed", lambda d: find(d, "PrometheusRule")["spec"]["groups"][1]["rules"][0].update(expr="sum(rate(x[5m])")),
        ("an alert its unit test disagrees with", mon, "promtool test rules failed", lambda d: find(d, "PrometheusRule")["spec"]["groups"][1]["rules"][0].update(expr="vector(0) > 1")),
    ]
    missed = []
    for what, name, expected, mutate in breaks:
        broken = copy.deepcopy(rendered)
        mutate(broken[name])
        errors = validate(broken, plain, DEPLOY / "Dockerfile")
        if not any(expected in e for e in errors):
            missed.append(f"{what} (errors: {errors})")
        else:
            print(f"self-test: caught {what}")
    # The scrape job for a Prometheus without the operator.
    config = yaml.safe_load((DEPLOY / SCRAPE_CONFIG).read_text())

    def keep_rule(c: dict) -> dict:
        return next(r for r in c["scrape_configs"][0]["relabel_configs"] if r.get("action") == "keep")

    def without_target(c: dict, label: str) -> None:
        rules = c["scrape_configs"][0]["relabel_configs"]
        rules.remove(next(r for r in rules if r.get("target_label") == label))

    scrape_breaks: list[tuple[str, str, Callable[[dict], None]]] = [
        ("a scrape job named otherwise", "job_name must be agentd", lambda c: c["scrape_configs"][0].update(job_name="kubernetes-pods")),
        ("series without a namespace", "the series need namespace='agentd'", lambda c: without_target(c, "namespace")),
        ("series without a pod", "the series need pod='agentd-0'", lambda c: without_target(c, "pod")),
        ("every port of a pod scraped", "a pod must be one target, not 3", lambda c: keep_rule(c).update(regex="agentd;true;.*")),
        ("the annotation's path ignored", "at /metrics", lambda c: without_target(c, "__metrics_path__") or c["scrape_configs"][0].update(metrics_path="/")),
        ("every annotated pod scraped", "scrapes pods that are not agentd's", lambda c: keep_rule(c).update(regex=".*;true;admin")),
    ]
    for what, expected, mutate in scrape_breaks:
        broken = copy.deepcopy(config)
        mutate(broken)
        errors = validate(rendered, plain, DEPLOY / "Dockerfile", broken)
        if not any(expected in e for e in errors):
            missed.append(f"{what} (errors: {errors})")
        else:
            print(f"self-test: caught {what}")
    # The Dockerfile checks, on a single-stage image running as root.
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "Dockerfile"
        bad.write_text("FROM rust:1.95\nCOPY . .\nRUN cargo build\nENTRYPOINT [\"agentd\"]\n")
        if not check_dockerfile(bad):
            missed.append("a single-stage root Dockerfile")
        else:
            print("self-test: caught a single-stage root Dockerfile")
    # The renderer refuses what it does not implement.
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
        try:
            render(Path(tmp))
            missed.append("an unsupported Kustomize feature")
        except RenderError:
            print("self-test: caught an unsupported Kustomize feature")
    return missed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-test", action="store_true", help="also check that broken manifests are caught")
    ap.add_argument("--print", metavar="KUSTOMIZATION", help="print one rendered kustomization (e.g. overlays/postgres) and exit")
    args = ap.parse_args()

    if kubernetes_validate.utils.major_minor(KUBERNETES_VERSION) not in {
        kubernetes_validate.utils.major_minor(v) for v in kubernetes_validate.utils.all_versions()
    }:
        print(f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for {KUBERNETES_VERSION}", file=sys.stderr)
        return 2
    try:
        rendered, plain = render_all()
    except (RenderError, OSError, yaml.YAMLError, jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
        print(f"deploy/validate.py: cannot render: {e}", file=sys.stderr)
        return 1
    if args.print:
        print(yaml.safe_dump_all(rendered[args.print], sort_keys=False), end="")
        return 0
    try:
        errors = validate(rendered, plain, DEPLOY / "Dockerfile")
    except (SourceError, OSError) as e:
        print(f"deploy/validate.py: cannot read the sources: {e}", file=sys.stderr)
        return 1
    for e in errors:
        print(f"deploy/validate.py: {e}", file=sys.stderr)
    if errors:
        return 1
    count = sum(len(d) for d in {**rendered, **plain}.values())
    print(f"deploy/validate.py: {count} objects in {len(rendered)} kustomizations and {len(plain)} files valid against Kubernetes {KUBERNETES_VERSION}; grace arithmetic holds; alert rules pass their tests")
    if args.self_test:
        missed = self_test(rendered, plain)
        if missed:
            for m in missed:
                print(f"deploy/validate.py: self-test: NOT caught: {m}", file=sys.stderr)
            return 1
        print("deploy/validate.py: self-test: every break was caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
