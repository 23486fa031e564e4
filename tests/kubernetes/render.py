"""A small kustomize for scripts/check-kubernetes.sh: builds the kustomization trees of
deploy/kubernetes without a kustomize binary.

It implements only what those trees use, and refuses anything else rather than guess:
`resources` (files and kustomization folders), `components`, `labels` (pairs, includeTemplates;
not includeSelectors), `images` and `patches` that delete an object (`$patch: delete`). Like
kustomize it refuses a file resource outside the kustomization's folder, a folder that is an
ancestor of the one including it, a patch that matches nothing and two objects with one id.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

KUSTOMIZE_API = {
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
    "Component": "kustomize.config.k8s.io/v1alpha1",
}
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "components", "labels", "images", "patches"}
# Kinds whose pod template gets `labels` with includeTemplates, and whose pod spec `images` edits.
TEMPLATED_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class RenderError(Exception):
    pass


def load_documents(path: Path) -> list[dict]:
    """The YAML documents of a file (empty documents skipped); each must be a mapping."""
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    except yaml.YAMLError as e:
        raise RenderError(f"{path}: not valid YAML: {e}") from None
    for d in docs:
        if not isinstance(d, dict):
            raise RenderError(f"{path}: a document is not a mapping")
    return docs


def object_id(obj: dict) -> tuple:
    """API group, kind, namespace and name: what must be unique in one build."""
    group = obj.get("apiVersion", "").rpartition("/")[0]
    meta = obj.get("metadata") or {}
    return (group, obj.get("kind"), meta.get("namespace", ""), meta.get("name"))


def describe(obj: dict) -> str:
    return f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"


def check_object(obj: dict, where: Path) -> None:
    meta = obj.get("metadata")
    if not obj.get("apiVersion") or not obj.get("kind") or not isinstance(meta, dict) \
            or not meta.get("name"):
        raise RenderError(f"{where}: an object lacks apiVersion, kind or metadata.name")


class Build:
    """One tree's build: the objects, and every file it read."""

    def __init__(self, root: Path):
        self.root = Path(os.path.normpath(root))
        self.files: set[Path] = set()
        self.objects = self._build(self.root, "Kustomization", [], ())

    def _kustomization(self, directory: Path, kind: str) -> dict:
        for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
            path = directory / name
            if path.is_file():
                break
        else:
            raise RenderError(f"{directory}: no kustomization.yaml")
        self.files.add(path)
        k = yaml.safe_load(path.read_text(encoding="utf-8"))
        if not isinstance(k, dict):
            raise RenderError(f"{path}: not a mapping")
        unsupported = set(k) - SUPPORTED_FIELDS
        if unsupported:
            raise RenderError(f"{path}: {', '.join(sorted(unsupported))}: not implemented by "
                              "tests/kubernetes/render.py (add it there first)")
        if k.get("kind", "Kustomization") != kind:
            raise RenderError(f"{path}: kind {k.get('kind')}, expected {kind} here")
        if k.get("apiVersion") != KUSTOMIZE_API[kind]:
            raise RenderError(f"{path}: apiVersion {k.get('apiVersion')}, expected "
                              f"{KUSTOMIZE_API[kind]}")
        return k

    def _build(self, directory: Path, kind: str, objects: list, parents: tuple) -> list:
        for parent in parents:
            if parent == directory or parent.is_relative_to(directory):
                raise RenderError(f"{parent}: includes its ancestor {directory} (a cycle)")
        k = self._kustomization(directory, kind)
        objects = list(objects)
        ids = {object_id(o) for o in objects}

        def add(obj: dict, where: Path) -> None:
            check_object(obj, where)
            if object_id(obj) in ids:
                raise RenderError(f"{where}: {describe(obj)} is already in this build")
            ids.add(object_id(obj))
            objects.append(obj)

        for entry in k.get("resources") or []:
            path = Path(os.path.normpath(directory / entry))
            if path.is_dir():
                for obj in self._build(path, "Kustomization", [], parents + (directory,)):
                    add(obj, path)
            elif path.is_file():
                if not path.is_relative_to(directory):
                    raise RenderError(f"{directory}: file {entry} is outside the kustomization's "
                                      "folder (kustomize refuses it)")
                self.files.add(path)
                for obj in load_documents(path):
                    add(obj, path)
            else:
                raise RenderError(f"{directory}: resource {entry}: no such file or folder")
        for entry in k.get("components") or []:
            path = Path(os.path.normpath(directory / entry))
            if not path.is_dir():
                raise RenderError(f"{directory}: component {entry}: no such folder")
            objects = self._build(path, "Component", objects, parents + (directory,))
            ids = {object_id(o) for o in objects}
        where = directory / "kustomization.yaml"
        objects = apply_patches(k.get("patches") or [], objects, where)
        apply_labels(k.get("labels") or [], objects, where)
        apply_images(k.get("images") or [], objects, where)
        return objects


def apply_patches(patches: list, objects: list, where: Path) -> list:
    for entry in patches:
        if not isinstance(entry, dict) or set(entry) != {"patch"}:
            raise RenderError(f"{where}: only inline `patch:` entries are implemented")
        patch = yaml.safe_load(entry["patch"])
        if not isinstance(patch, dict) or patch.get("$patch") != "delete":
            raise RenderError(f"{where}: only `$patch: delete` patches are implemented")
        target = (patch.get("apiVersion"), patch.get("kind"),
                  (patch.get("metadata") or {}).get("name"))
        kept = [o for o in objects
                if (o["apiVersion"], o["kind"], o["metadata"]["name"]) != target]
        if len(kept) == len(objects):
            raise RenderError(f"{where}: the patch deleting {target[1]}/{target[2]} "
                              f"({target[0]}) matches no object")
        objects = kept
    return objects


def apply_labels(entries: list, objects: list, where: Path) -> None:
    for entry in entries:
        unsupported = set(entry) - {"pairs", "includeSelectors", "includeTemplates"}
        if unsupported or entry.get("includeSelectors"):
            raise RenderError(f"{where}: labels: only pairs and includeTemplates are implemented")
        pairs = entry.get("pairs") or {}
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(pairs)
            if entry.get("includeTemplates") and obj["kind"] in TEMPLATED_KINDS:
                template = obj.setdefault("spec", {}).setdefault("template", {})
                template.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def split_image(image: str) -> tuple[str, str, str]:
    """name, tag, digest of an image reference."""
    name, _, digest = image.partition("@")
    tag = ""
    if ":" in name.rpartition("/")[2]:
        name, _, tag = name.rpartition(":")
    return name, tag, digest


def pod_specs(obj: dict) -> list:
    if obj["kind"] == "Pod":
        return [obj.get("spec") or {}]
    if obj["kind"] in TEMPLATED_KINDS:
        return [((obj.get("spec") or {}).get("template") or {}).get("spec") or {}]
    return []


def apply_images(entries: list, objects: list, where: Path) -> None:
    for entry in entries:
        unsupported = set(entry) - {"name", "newName", "newTag", "digest"}
        if unsupported or not entry.get("name"):
            raise RenderError(f"{where}: images: only name, newName, newTag and digest")
        matched = False
        for obj in objects:
            for spec in pod_specs(obj):
                for container in (spec.get("containers") or []) + \
                        (spec.get("initContainers") or []):
                    name, tag, digest = split_image(container.get("image", ""))
                    if name != entry["name"]:
                        continue
                    matched = True
                    image = entry.get("newName", name)
                    if entry.get("digest"):
                        image += "@" + entry["digest"]
                    elif entry.get("newTag"):
                        image += ":" + str(entry["newTag"])
                    elif digest:
                        image += "@" + digest
                    elif tag:
                        image += ":" + tag
                    container["image"] = image
        # kustomize ignores an entry that matches nothing; here it is a mistake (a renamed
        # image that `kustomize edit set image` would no longer reach).
        if not matched:
            raise RenderError(f"{where}: images: {entry['name']} matches no container")
