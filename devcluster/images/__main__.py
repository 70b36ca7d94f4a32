"""`python -m disagg.devcluster.images build [NAME ...] [--containerd ADDRESS]`: build the node's images (cached by
their inputs) and optionally import them into a containerd; `list` prints names, references and cache state;
`verify-engine` imports vLLM in the engine image's root filesystem with the host mounts and compiles a kernel with
torch inductor."""
from __future__ import annotations

import argparse
import time

from .. import build
from . import catalog, engine


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m disagg.devcluster.images", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build every image (or those named), cached by their inputs")
    b.add_argument("names", nargs="*", metavar="NAME",
                   help=f"images to build (default all: {', '.join(catalog.BUILDERS)})")
    b.add_argument("--containerd", metavar="ADDRESS", help="also import them into this containerd socket")
    b.add_argument("--namespace", default="k8s.io")
    b.add_argument("--ctr", default=None, help="the ctr binary (default: the one `disagg cluster build` made)")
    sub.add_parser("list", help="the images, their references and whether they are built")
    sub.add_parser("verify-engine", help="import vllm and nixl, and compile with inductor, in a chroot of the "
                   "engine image with the host mounts")
    args = p.parse_args(argv)
    unknown = sorted(set(getattr(args, "names", None) or ()) - set(catalog.BUILDERS))
    if unknown:
        p.error(f"unknown image(s) {', '.join(unknown)}; known: {', '.join(catalog.BUILDERS)}")
    if args.cmd == "list":
        for img in catalog.planned():
            print(f"{img.name:10} {img.reference:45} {'built' if img.is_built() else 'not built'}  {img.tar}")
    elif args.cmd == "verify-engine":
        print(engine.verify())
    else:
        start = time.monotonic()
        names = args.names or None
        if args.containerd:
            refs = catalog.ensure_images(args.ctr or build.bin_dir() / "ctr", args.containerd, args.namespace, names)
        else:
            refs = {img.name: img.reference for img in catalog.build_all(names)}
        for name, ref in refs.items():
            print(f"{name}: {ref}")
        print(f"[images] done in {time.monotonic() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
