"""Build script. Metadata lives in pyproject.toml; this file adds the compiled extensions.

When torch can be imported at build time (``pip install --no-build-isolation .``), every ``csrc/cpu/*.cpp``
is compiled ahead of time into ``fastarch._cpu_<name>`` (and ``csrc/cuda/*.cu`` into ``fastarch._cuda_<name>``
against a CUDA torch). A failed compile never fails the install: the extension is left to the just-in-time
path, and ``fastarch info`` shows the reason. Without torch at build time nothing is compiled here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
# fastarch/kernels is a link to ./kernels, so fastarch.kernels is found as an ordinary subpackage;
# fastarch/_csrc links ./csrc so that wheels carry the sources for just-in-time builds.
packages = find_packages(include=["fastarch", "fastarch.*"])
if "fastarch.kernels" not in packages:
    packages.append("fastarch.kernels")

ext_modules: list = []
cmdclass: dict = {}

if os.environ.get("FASTARCH_NO_AOT") != "1":
    try:
        import torch  # noqa: F401
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        torch = None  # type: ignore[assignment]

    if torch is not None:
        sys.path.insert(0, str(HERE))
        from fastarch import extensions as fx  # noqa: E402

        for name, kind in fx.all_extensions():
            src = [str(p.relative_to(HERE)) for p in fx.sources(name, kind)]
            inc = [str(HERE / "csrc" / kind / "include")]
            if kind == "cpu":
                ext_modules.append(CppExtension(
                    f"fastarch.{fx.module_name(name, kind)}", src, include_dirs=inc,
                    extra_compile_args=fx.cpu_cflags(), extra_link_args=fx.CPU_LDFLAGS))
            elif torch.version.cuda is not None and CUDA_HOME is not None:
                ext_modules.append(CUDAExtension(
                    f"fastarch.{fx.module_name(name, kind)}", src, include_dirs=inc,
                    extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": fx.CUDA_CFLAGS}))

        class TolerantBuildExtension(BuildExtension):
            """Builds what compiles and records the source hash of each success for staleness checks.

            Re-running the installer does not recompile: an extension whose in-tree build (left by the last
            editable install) records the same source hash, and was not rewritten after that record, is
            copied to the build target instead. ``FASTARCH_REBUILD=1`` compiles everything again.
            """

            def run(self) -> None:
                self.built: dict[str, str] = {}
                super().run()
                manifest = Path(self.get_ext_fullpath("fastarch._x")).parent / "_aot_manifest.json"
                if self.inplace:
                    manifest = HERE / "fastarch" / "_aot_manifest.json"
                manifest.parent.mkdir(parents=True, exist_ok=True)
                tmp = manifest.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.built, indent=1, sort_keys=True))
                os.replace(tmp, manifest)

            def _reuse_in_tree(self, ext, short: str, want: str) -> bool:
                if os.environ.get("FASTARCH_REBUILD") == "1":
                    return False
                target = Path(self.get_ext_fullpath(ext.name))
                in_tree = HERE / "fastarch" / target.name
                manifest = HERE / "fastarch" / "_aot_manifest.json"
                try:
                    recorded = json.loads(manifest.read_text()).get(short)
                    # rewritten after the record: an interrupted build
                    fresh = in_tree.stat().st_mtime <= manifest.stat().st_mtime
                except (OSError, ValueError):
                    return False
                if recorded != want or not fresh:
                    return False
                if in_tree.resolve() != target.resolve():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(in_tree, target)
                print(f"fastarch: {ext.name} is up to date (source hash {want}), not recompiled", file=sys.stderr)
                return True

            def build_extension(self, ext) -> None:
                short = ext.name.split(".")[-1]
                kind, _, name = short[1:].partition("_")
                want = fx.source_hash(name, kind)
                if self._reuse_in_tree(ext, short, want):
                    self.built[short] = want
                    return
                try:
                    super().build_extension(ext)
                except Exception as exc:  # left to the just-in-time path
                    print(f"fastarch: could not build {ext.name} ahead of time ({exc}); it will be built "
                          f"just in time on first use", file=sys.stderr)
                    return
                self.built[short] = want

        cmdclass["build_ext"] = TolerantBuildExtension.with_options(use_ninja=True)

setup(
    packages=packages,
    package_data={"fastarch": ["_csrc/cpu/*.cpp", "_csrc/cpu/include/*", "_csrc/cuda/*.cu",
                               "_csrc/cuda/include/*", "_aot_manifest.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
