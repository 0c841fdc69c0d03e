"""Build script. Metadata lives in pyproject.toml; this file lays out the package and adds the extensions.

Layout: ``kernels/`` is installed as the subpackage ``fastarch.kernels`` and ``csrc/`` as the package data
``fastarch._csrc``, so that an installed fastarch can still build its extensions just in time.

Extensions: when torch can be imported at build time (``pip install --no-build-isolation .``), every
``csrc/cpu/NAME.cpp`` is compiled ahead of time into ``fastarch._cpu_NAME_<hash>`` (and ``csrc/cuda/NAME.cu``
into ``fastarch._cuda_NAME_<hash>`` against a CUDA torch), with the portable flags and the hash described
in ``fastarch/extensions.py``. A failed compile never fails the install: the extension is left to the
just-in-time path, and ``fastarch info`` shows the reason. Without torch at build time nothing is compiled.

Incremental builds: ninja compiles each extension in its own folder under ``build/temp.*``, which is kept
between installs (pip would otherwise build in a fresh temporary folder every time). ninja recompiles an
object only when its command line, its source or a header the compiler reported as included changed, so
re-running the installer only links the unchanged extensions again. ``FASTARCH_REBUILD=1`` (or deleting
``build/``) compiles everything from scratch.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import find_namespace_packages, find_packages, setup

HERE = Path(__file__).resolve().parent

ext_modules: list = []
cmdclass: dict = {}

if os.environ.get("FASTARCH_NO_AOT") != "1":
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        torch = None  # type: ignore[assignment]

    if torch is not None:
        sys.path.insert(0, str(HERE))
        from fastarch import extensions as fx

        for name, kind in fx.all_extensions():
            full_name = f"fastarch.{fx.aot_module_name(name, kind)}"
            src = [str(p.relative_to(HERE)) for p in fx.sources(name, kind)]
            inc = [str(p) for p in fx.include_dirs(kind)]
            if kind == "cpu":
                ext_modules.append(CppExtension(
                    full_name, src, include_dirs=inc, extra_compile_args=fx.cpu_cflags(ahead_of_time=True),
                    extra_link_args=fx.CPU_LDFLAGS))
            elif torch.version.cuda is not None and CUDA_HOME is not None:
                ext_modules.append(CUDAExtension(
                    full_name, src, include_dirs=inc,
                    extra_compile_args={"cxx": fx.CUDA_CXXFLAGS, "nvcc": fx.CUDA_CFLAGS}))

        class TolerantBuildExtension(BuildExtension):
            """Builds what compiles, each extension in its own persistent ninja folder."""

            def finalize_options(self) -> None:
                super().finalize_options()
                self.build_temp = str(HERE / "build" / f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}")

            def run(self) -> None:
                if os.environ.get("FASTARCH_REBUILD") == "1":
                    shutil.rmtree(self.build_temp, ignore_errors=True)
                super().run()
                if self.inplace or getattr(self, "editable_mode", False):
                    self._remove_stale_in_tree_builds()

            def _remove_stale_in_tree_builds(self) -> None:
                # Builds of older sources stay in the tree after an editable install; none would be loaded.
                current = {e.name.rpartition(".")[2] for e in self.extensions}
                for path in (HERE / "fastarch").glob("_c*_*.*"):
                    if path.suffix in (".so", ".pyd") and path.name.split(".")[0] not in current:
                        path.unlink()

            def build_extension(self, ext) -> None:
                # torch writes one build.ninja per extension into the build folder, and extensions build in
                # parallel (setup.cfg), so each gets a folder of its own, named without the source hash.
                own = copy.copy(self)
                own.build_temp = os.path.join(self.build_temp, ext.name.rpartition(".")[2].rpartition("_")[0])
                try:
                    BuildExtension.build_extension(own, ext)
                except Exception as exc:  # left to the just-in-time path
                    print(f"fastarch: could not build {ext.name} ahead of time ({exc}); it will be built "
                          f"just in time on first use", file=sys.stderr)

        cmdclass["build_ext"] = TolerantBuildExtension.with_options(use_ninja=True)

# csrc/ holds no Python; its folders are listed as packages so that setuptools ships their files as data.
csrc_packages = ["fastarch._csrc"] + [f"fastarch._csrc.{p}" for p in find_namespace_packages(where=str(HERE / "csrc"))]

setup(
    packages=find_packages(include=["fastarch", "fastarch.*"]) + csrc_packages,
    package_dir={"fastarch._csrc": "csrc"},
    package_data={"fastarch._csrc": ["cpu/*.cpp", "cpu/include/*", "cuda/*.cu", "cuda/include/*"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
