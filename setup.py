"""Builds rl_engine._C: CPU kernels always; the sm_90a kernels when a CUDA toolkit and a CUDA torch
are present (RLK_BUILD_CUDA=1 forces them, RLK_BUILD_CUDA=0 leaves them out).
RLK_PREBUILT_EXTENSION=FILE installs FILE as rl_engine._C instead of compiling (a build of these same
sources kept from an earlier run; benchmarks/gpu_steps.sh checks that it is)."""

import json
import os
import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
PREBUILT = os.environ.get("RLK_PREBUILT_EXTENSION", "").strip()


class _CopyPrebuilt(build_ext):
    def build_extension(self, ext):
        source = Path(PREBUILT)
        if not source.is_file():
            raise FileNotFoundError(f"RLK_PREBUILT_EXTENSION={PREBUILT}: no such file; unset it to compile")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)


def _cuda_wanted() -> bool:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    switch = os.environ.get("RLK_BUILD_CUDA", "auto").strip().lower()
    if switch not in {"auto", "0", "1"}:
        raise ValueError(f"RLK_BUILD_CUDA={switch!r}: use auto, 0 or 1")
    available = torch.version.cuda is not None and CUDA_HOME is not None
    if switch == "1" and not available:
        raise RuntimeError("RLK_BUILD_CUDA=1 but no CUDA torch or CUDA toolkit (CUDA_HOME) was found")
    return switch == "1" or (switch == "auto" and available)


def _extension():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp"))
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off"]
    include_dirs = [str(ROOT / "include"), str(ROOT / "csrc")]
    with_cuda = _cuda_wanted()
    nvcc = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--use_fast_math",
            "-lineinfo", "--expt-relaxed-constexpr"]
    info = {"cxx": cxx, "cuda": with_cuda, "nvcc": nvcc if with_cuda else []}
    macros = [("RL_ENGINE_BUILD_INFO", json.dumps(json.dumps(info)))]
    if with_cuda:
        sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu"))
        macros.append(("RL_ENGINE_WITH_SM90", "1"))
        return CUDAExtension("rl_engine._C", sources, include_dirs=include_dirs, define_macros=macros,
                             extra_compile_args={"cxx": cxx + ["-DRL_ENGINE_WITH_SM90"], "nvcc": nvcc},
                             extra_link_args=["-fopenmp", "-lcuda"])
    return CppExtension("rl_engine._C", sources, include_dirs=include_dirs, define_macros=macros,
                        extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])


def _build_ext():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


if PREBUILT:
    setup(ext_modules=[Extension("rl_engine._C", [])], cmdclass={"build_ext": _CopyPrebuilt})
else:
    setup(ext_modules=[_extension()], cmdclass={"build_ext": _build_ext()})
