"""What ``make install`` installs where: torch's CPU or CUDA build, and flash-attn from a prebuilt wheel.

    python workbench/installer.py torch [PIP ARGS...]   # before the project: the pinned torch
    python workbench/installer.py flash-attn            # after it: flash-attn, on CUDA machines only

``torch``: where ``nvidia-smi -L`` lists a GPU, ``pip install torch==2.13.0`` (the package index's
default Linux build carries CUDA), then a check that the installed torch has CUDA, saying how to get
the CUDA build when it has not; elsewhere the same command finds the CPU build (offline through
pip's find-links on the project's machines). ``TORCH_PIP_ARGS`` are passed through.

``flash-attn``: nothing on a CPU build of torch. With CUDA, flash-attn's release wheel built for this
torch (major.minor), CUDA (major), C++ ABI and Python, when the release has one (checked with one
HTTP HEAD request); otherwise one line says that the PyTorch attention path will be used. A source
build takes from 10 minutes to over an hour and needs nvcc, so it happens only when asked:
``FLASH_ATTN_BUILD=1``. ``FLASH_ATTN_VERSION`` picks another release. The install never fails
because of flash-attn (the PyTorch path always works), except a build that was asked for.

Standard library only: it runs before the project is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["TORCH_VERSION", "FLASH_ATTN_VERSION", "WHEEL_URL", "cuda_present", "torch_command", "wheel_name",
           "FlashPlan", "plan_flash_attn", "main"]

TORCH_VERSION = "2.13.0"
FLASH_ATTN_VERSION = "2.8.3"
"""The flash-attn release whose wheels are looked for (``FLASH_ATTN_VERSION`` overrides it)."""
WHEEL_URL = "https://github.com/Dao-AILab/flash-attention/releases/download/v{version}/{wheel}"
"""Where flash-attn's release wheels are (the URL its own setup.py downloads from)."""

Say = Callable[[str], None]


def _say(msg: str) -> None:
    print(f"install: {msg}", flush=True)


def cuda_present(run: Callable[[list[str]], int] | None = None) -> bool:
    """Whether ``nvidia-smi -L`` lists a GPU here (the driver is installed and sees one)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return False
    if run is None:
        def run(cmd):
            try:
                return subprocess.run(cmd, capture_output=True, timeout=30).returncode
            except (OSError, subprocess.TimeoutExpired):
                return 1
    return run([exe, "-L"]) == 0


def torch_command(python: str, pip_args: Sequence[str] = ()) -> list[str]:
    """The pip command that installs the pinned torch (the same on CPU and CUDA machines: the
    index's Linux default is the CUDA build, the project's CPU machines find the CPU wheel offline)."""
    return [python, "-m", "pip", "install", *pip_args, f"torch=={TORCH_VERSION}"]


def wheel_name(*, flash_version: str, torch_version: str, cuda_version: str, cxx11_abi: bool, python_tag: str,
               platform_tag: str) -> str:
    """flash-attn's release wheel for this build, named as its setup.py names them:
    ``flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp311-cp311-linux_x86_64.whl`` (CUDA major only:
    one wheel per CUDA major serves every minor; torch major.minor; the local version of torch,
    ``+cu128``, dropped)."""
    tv = torch_version.split("+")[0].split(".")
    cuda_major = cuda_version.split(".")[0]
    abi = "TRUE" if cxx11_abi else "FALSE"
    return (f"flash_attn-{flash_version}+cu{cuda_major}torch{tv[0]}.{tv[1]}cxx11abi{abi}-"
            f"{python_tag}-{python_tag}-{platform_tag}.whl")


@dataclass(frozen=True)
class FlashPlan:
    """What the flash-attn step does: ``nothing`` (no CUDA, or already installed), ``wheel``
    (install ``target``, a URL), ``build`` (pip builds ``target``, a requirement), or ``fallback``
    (no wheel: the PyTorch path). ``message`` is the line said."""

    action: str
    target: str
    message: str


def plan_flash_attn(build: dict, *, url_exists: Callable[[str], bool | None], env: dict | None = None) -> FlashPlan:
    """Decide the flash-attn step from the installed torch's ``build`` (``{"torch", "cuda", "cxx11_abi",
    "python_tag", "platform_tag", "flash_attn"}``: what ``_torch_build`` reports) and whether a URL
    exists (None: could not tell, e.g. offline)."""
    env = dict(os.environ if env is None else env)
    ver = env.get("FLASH_ATTN_VERSION") or FLASH_ATTN_VERSION
    if not build.get("cuda"):
        return FlashPlan("nothing", "", f"torch {build.get('torch')} is a CPU build: flash-attn needs CUDA; training "
                                        f"uses the PyTorch attention path")
    if build.get("flash_attn"):
        return FlashPlan("nothing", "", f"flash-attn {build['flash_attn']} is already installed")
    name = wheel_name(flash_version=ver, torch_version=build["torch"], cuda_version=build["cuda"],
                      cxx11_abi=bool(build.get("cxx11_abi")), python_tag=build["python_tag"],
                      platform_tag=build["platform_tag"])
    url = WHEEL_URL.format(version=ver, wheel=name)
    found = url_exists(url)
    if found:
        return FlashPlan("wheel", url, f"installing flash-attn {ver} from its prebuilt wheel {name}")
    if env.get("FLASH_ATTN_BUILD", "") not in ("", "0"):
        return FlashPlan("build", f"flash-attn=={ver}", f"FLASH_ATTN_BUILD is set: building flash-attn {ver} from "
                                                        f"source (needs nvcc; 10 minutes to over an hour)")
    why = ("no prebuilt wheel" if found is False else "could not reach the release to look for a wheel")
    return FlashPlan("fallback", "", f"{why} of flash-attn {ver} for torch {build['torch']}, CUDA {build['cuda']}, "
                                     f"{build['python_tag']} ({name}): the PyTorch attention path will be used; "
                                     f"FLASH_ATTN_BUILD=1 make install builds flash-attn from source (long), "
                                     f"FLASH_ATTN_VERSION=X.Y.Z tries another release")


def _url_exists(url: str, timeout: float = 20.0) -> bool | None:
    """True when ``url`` answers 200 to a HEAD request (after redirects), False on 404, None when
    the network could not tell."""
    try:
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return 200 <= r.status < 300
    except urllib.error.HTTPError as e:
        return False if e.code in (403, 404) else None
    except (urllib.error.URLError, OSError, TimeoutError):
        return None


_PROBE = """
import json, sys, platform, importlib.util
out = {"python_tag": f"cp{sys.version_info.major}{sys.version_info.minor}",
       "platform_tag": f"linux_{platform.machine()}" if sys.platform.startswith("linux") else sys.platform}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI))
except Exception as e:
    out.update(torch=None, error=str(e))
fa = None
for mod in ("flash_attn", "flash_attn_interface"):
    if importlib.util.find_spec(mod) is not None:
        try:
            m = __import__(mod)
            fa = getattr(m, "__version__", "?")
        except Exception:
            fa = None
        break
out["flash_attn"] = fa
print(json.dumps(out))
"""


def _torch_build(python: str) -> dict:
    p = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"torch": None, "error": (p.stderr.strip().splitlines() or ["no output"])[-1]}


def install_torch(python: str, pip_args: Sequence[str], *, say: Say = _say,
                  run: Callable[[list[str]], int] | None = None, present: bool | None = None) -> int:
    """Install the pinned torch; on a CUDA machine check that it is the CUDA build. Returns pip's status."""
    run = run or (lambda cmd: subprocess.run(cmd).returncode)
    gpu = cuda_present() if present is None else present
    say(f"{'CUDA found (nvidia-smi lists a GPU)' if gpu else 'no CUDA'}: installing torch=={TORCH_VERSION}"
        + (" (the index's CUDA build)" if gpu else " (the CPU build)"))
    code = run(torch_command(python, pip_args))
    if code != 0 or not gpu:
        return code
    build = _torch_build(python)
    if not build.get("cuda"):
        say(f"warning: torch {build.get('torch')} has no CUDA although this machine has a GPU; install the CUDA build "
            f"with TORCH_PIP_ARGS='--index-url https://download.pytorch.org/whl/cu128' make clean install")
    else:
        say(f"torch {build['torch']} with CUDA {build['cuda']}")
    return 0


def install_flash_attn(python: str, *, say: Say = _say, run: Callable[[list[str]], int] | None = None,
                       build: dict | None = None, url_exists: Callable[[str], bool | None] = _url_exists,
                       env: dict | None = None) -> int:
    """The flash-attn step (module docstring). Returns 0 unless a build that was asked for failed."""
    run = run or (lambda cmd: subprocess.run(cmd).returncode)
    build = build or _torch_build(python)
    if build.get("torch") is None:
        say(f"flash-attn: torch does not import ({build.get('error')}); skipped")
        return 0
    plan = plan_flash_attn(build, url_exists=url_exists, env=env)
    say(f"flash-attn: {plan.message}")
    if plan.action == "wheel":
        if run([python, "-m", "pip", "install", "--no-deps", plan.target]) != 0:
            say("flash-attn: the wheel did not install: the PyTorch attention path will be used")
        return 0
    if plan.action == "build":
        code = run([python, "-m", "pip", "install", "--no-build-isolation", plan.target])
        if code != 0:
            say("flash-attn: the source build failed (see above): the PyTorch attention path will be used")
        return code
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("torch", "flash-attn"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    python = sys.executable
    if argv[0] == "torch":
        return install_torch(python, argv[1:])
    return install_flash_attn(python)


if __name__ == "__main__":
    sys.exit(main())
