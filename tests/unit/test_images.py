"""The image builder's pure parts: the OCI layout writer (digests, sizes, names, what the layer tar keeps) and the
input keys images are cached by."""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tarfile
from pathlib import Path

import pytest

from disagg.devcluster.images import base, containerd, engine, oci, operator_image
from disagg.devcluster.images.artifact import Image, ensure_layout
from disagg.devcluster.images.cache import tree_digest


@pytest.fixture
def rootfs(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "etc").mkdir()
    (root / "dev").mkdir()
    (root / "dev" / "null-ish").write_text("runtime's, not the image's")
    tool = root / "usr" / "bin" / "python3.11"
    tool.write_bytes(b"\x7fELF pretend")
    tool.chmod(0o755)
    (root / "usr" / "bin" / "python3").symlink_to("python3.11")
    os.link(tool, root / "usr" / "bin" / "python3.11-link")
    secret = root / "etc" / "shadow"
    secret.write_text("root:*:")
    secret.chmod(0o640)
    (root / ".disagg-complete").write_text("cache marker")
    return root


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_layer_keeps_modes_symlinks_and_hard_links_and_skips_runtime_content(rootfs, tmp_path):
    layer = oci.write_layer(rootfs, tmp_path / "layer.tar")
    data = layer.path.read_bytes()
    assert layer.digest == sha256(data) and layer.size == len(data)
    with tarfile.open(layer.path) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert "dev" in members and "dev/null-ish" not in members, "/dev is the runtime's: the directory only"
    assert ".disagg-complete" not in members
    assert not [n for n in members if n.startswith("/")]
    assert stat.S_IMODE(members["usr/bin/python3.11"].mode) == 0o755
    assert stat.S_IMODE(members["etc/shadow"].mode) == 0o640
    assert members["usr/bin/python3"].issym() and members["usr/bin/python3"].linkname == "python3.11"
    # The second path to an inode is a hard link to the first one written (sorted order).
    assert members["usr/bin/python3.11"].isfile()
    assert members["usr/bin/python3.11-link"].islnk()
    assert members["usr/bin/python3.11-link"].linkname == "usr/bin/python3.11"
    assert all(m.uname == "" and m.gname == "" for m in members.values()), "numeric owners only"


def test_layout_is_valid_digests_and_sizes_match_and_the_index_names_the_image(rootfs, tmp_path):
    layer = oci.write_layer(rootfs, tmp_path / "layer.tar")
    run = oci.RunConfig(env=("PATH=/usr/bin",), entrypoint=("disagg",), cmd=("--help",), user="65532:65532",
                        working_dir="/src", labels={"a": "b"})
    desc = oci.write_layout(tmp_path / "layout", "disagg.local/disagg:0123abcd", [layer], run)
    layout = tmp_path / "layout"
    assert json.loads((layout / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    idx = json.loads((layout / "index.json").read_text())
    assert idx["schemaVersion"] == 2 and idx["mediaType"] == oci.INDEX
    (entry,) = idx["manifests"]
    assert entry["annotations"] == {"io.containerd.image.name": "disagg.local/disagg:0123abcd",
                                    "org.opencontainers.image.ref.name": "0123abcd"}

    def blob(d: dict) -> bytes:
        data = (layout / "blobs" / "sha256" / d["digest"].split(":")[1]).read_bytes()
        assert sha256(data) == d["digest"] and len(data) == d["size"], d
        return data

    man = json.loads(blob(entry))
    assert entry["digest"] == desc.digest and entry["mediaType"] == oci.MANIFEST
    assert man["mediaType"] == oci.MANIFEST and man["config"]["mediaType"] == oci.CONFIG
    assert [d["mediaType"] for d in man["layers"]] == [oci.LAYER_TAR]
    assert blob(man["layers"][0]) == layer.path.read_bytes()
    cfg = json.loads(blob(man["config"]))
    assert cfg["rootfs"] == {"type": "layers", "diff_ids": [layer.digest]}, "uncompressed: diff ID = digest"
    assert (cfg["os"], cfg["architecture"]) == ("linux", "amd64")
    assert cfg["config"] == {"Env": ["PATH=/usr/bin"], "Entrypoint": ["disagg"], "Cmd": ["--help"],
                             "User": "65532:65532", "WorkingDir": "/src", "Labels": {"a": "b"}}
    assert len(cfg["history"]) == 1


def test_packed_layout_holds_the_same_files(rootfs, tmp_path):
    layer = oci.write_layer(rootfs, tmp_path / "layer.tar")
    oci.write_layout(tmp_path / "layout", "disagg.local/x:1", [layer], oci.RunConfig())
    packed = oci.pack(tmp_path / "layout", tmp_path / "x.tar")
    with tarfile.open(packed) as tar:
        names = tar.getnames()
        assert names[:2] == ["oci-layout", "index.json"]
        for name in names:
            member = tar.getmember(name)
            if member.isfile():
                extracted = tar.extractfile(member)
                assert extracted is not None
                assert extracted.read() == (tmp_path / "layout" / name).read_bytes()
    blobs = {n.rsplit("/", 1)[1] for n in names if n.startswith("blobs/sha256/")}
    assert layer.digest.split(":")[1] in blobs and len(blobs) == 3


def test_a_cached_image_is_not_rewritten(rootfs, tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path / "cache"))
    calls = []

    def layers() -> list[oci.Layer]:
        calls.append(1)
        return [oci.write_layer(rootfs, tmp_path / "layer.tar")]

    img = Image("x", "k1")
    ensure_layout(img, layers, oci.RunConfig())
    ensure_layout(img, layers, oci.RunConfig())
    assert len(calls) == 1 and img.is_built() and img.tar.parent == tmp_path / "cache" / "images" / "oci"
    assert (img.reference, img.stable) == ("disagg.local/x:k1", "disagg.local/x:dev")


def test_tree_digest_follows_names_contents_and_exec_bits_but_not_bytecode(tmp_path):
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("hi")
    d0 = tree_digest(tmp_path, ["README.md", "pkg"])
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"junk")
    assert tree_digest(tmp_path, ["README.md", "pkg"]) == d0
    (tmp_path / "pkg" / "a.py").chmod(0o755)
    d1 = tree_digest(tmp_path, ["README.md", "pkg"])
    assert d1 != d0
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert tree_digest(tmp_path, ["README.md", "pkg"]) not in (d0, d1)
    (tmp_path / "pkg" / "b.py").write_text("")
    assert len({d0, d1, tree_digest(tmp_path, ["README.md", "pkg"])}) == 3


def test_base_key_changes_with_suite_and_packages_not_their_order():
    spec = base.BaseSpec()
    assert base.BaseSpec(packages=tuple(reversed(spec.packages))).key == spec.key
    assert base.BaseSpec(packages=(*spec.packages, "curl")).key != spec.key
    assert base.BaseSpec(suite="trixie").key != spec.key
    assert base.image(base.BaseSpec(suite="trixie")).key != base.image(spec).key
    argv = spec.debootstrap_argv(Path("/t"))
    assert argv[:2] == ["debootstrap", "--variant=minbase"] and "python3-pip" in argv[2] and argv[3] == "bookworm"


def test_operator_image_key_follows_the_build_context_dockerfile_and_base(tmp_path):
    repo = tmp_path / "repo"
    for name in operator_image.CONTEXT:
        if "." in name:
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(name)
        else:
            (repo / name).mkdir(parents=True)
            (repo / name / "m.py").write_text("")
    for name in operator_image.BUILD_FILES:
        (repo / name).write_text(name)
    k0 = operator_image.image(repo=repo).key
    (repo / "tests").mkdir()
    (repo / "tests" / "t.py").write_text("not in the context")
    assert operator_image.image(repo=repo).key == k0
    (repo / "connector" / "m.py").write_text("changed")
    k1 = operator_image.image(repo=repo).key
    (repo / "Dockerfile").write_text("FROM other")
    k2 = operator_image.image(repo=repo).key
    assert len({k0, k1, k2}) == 3
    assert operator_image.image(base.BaseSpec(suite="trixie"), repo=repo).key != k2
    staged = operator_image.stage_context(repo, tmp_path / "ctx")
    assert sorted(p.name for p in staged.iterdir()) == sorted(operator_image.CONTEXT + operator_image.BUILD_FILES)


def test_frontend_options_keep_the_builtin_frontend_and_serve_from_from_the_base():
    opts = operator_image.frontend_opts("sha256:abc")
    assert "context:python:3.11-slim-bookworm=oci-layout://base@sha256:abc" in opts
    assert any(o.startswith("cmdline=") for o in opts), "without it, # syntax= pulls a frontend from Docker Hub"


def test_engine_image_names_the_host_python_and_the_mounts_it_needs():
    env = engine.host_env_of(Path("/c/vllm-venv"), "home = /p/versions/3.11.7/bin\nversion = 3.11.7\n")
    assert env.mounts == (Path("/p/versions/3.11.7"), Path("/c/vllm-venv"))
    run = engine.run_config(env)
    assert "DISAGG_PYTHON=/c/vllm-venv/bin/python" in run.env
    assert next(e for e in run.env if e.startswith("PATH=")).startswith("PATH=/c/vllm-venv/bin:")
    assert run.labels[engine.MOUNTS_LABEL] == "/p/versions/3.11.7,/c/vllm-venv"
    other = engine.host_env_of(Path("/d/venv"), "home = /p/versions/3.11.7/bin\n")
    assert engine.image(env).key != engine.image(other).key


def test_only_images_missing_under_their_key_are_imported():
    a, b = Image("disagg", "k2"), Image("pause", "k1")
    present = {"disagg.local/disagg:k1", "disagg.local/disagg:dev", "disagg.local/pause:k1"}
    assert containerd.to_import([a, b], present) == [a]


def test_throwaway_containerd_config_has_the_settings_the_real_node_needed(tmp_path):
    toml = containerd.config_toml(tmp_path, Path("/bin/runc"))
    assert toml.startswith("version = 3")
    for line in ("restrict_oom_score_adj = true", "snapshotter = 'overlayfs'", "BinaryName = '/bin/runc'",
                 f"address = '{tmp_path}/containerd.sock'", f"root = '{tmp_path}/root'"):
        assert line in toml


CERT_A = "-----BEGIN CERTIFICATE-----\nAAAA\nAAAA\n-----END CERTIFICATE-----"
CERT_B = "-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----"


def test_extra_cas_are_the_host_certificates_debian_does_not_ship():
    bundle = f"{CERT_A}\n{CERT_B}\n  {CERT_B}\n"
    assert base.extra_cas(bundle, [CERT_A + "\n"]) == [CERT_B], "stock ones dropped, duplicates once"
    assert base.extra_cas(bundle, [CERT_A, CERT_B]) == []
    assert base.cas_digest([]) == "" and base.cas_digest([CERT_A]) != base.cas_digest([CERT_B])


def test_ca_layer_appends_the_extra_cas_to_the_bundle(tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path / "cache"))
    spec = base.BaseSpec()
    rootfs = base.rootfs_dir(spec)
    (rootfs / "etc" / "ssl" / "certs").mkdir(parents=True)
    (rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt").write_text(CERT_A + "\n")
    (rootfs / ".disagg-complete").write_text(spec.key)
    layer = base.ca_layer(spec, [CERT_B], progress=False)
    with tarfile.open(layer.path) as tar:
        bundle = tar.extractfile("etc/ssl/certs/ca-certificates.crt")
        local = tar.extractfile("usr/local/share/ca-certificates/disagg-host-0.crt")
        assert bundle is not None and local is not None
        assert base.pem_blocks(bundle.read().decode()) == [CERT_A, CERT_B]
        assert local.read().decode().strip() == CERT_B
        assert all(stat.S_IMODE(m.mode) == 0o755 for m in tar.getmembers() if m.isdir())
