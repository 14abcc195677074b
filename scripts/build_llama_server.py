"""Builds llama.cpp's `llama-server` from the llama.cpp source that llama-cpp-python vendors, so
that `strata-rs bench --conversations --llama-server PATH` compares with the same llama.cpp the
other benchmarks use (llama-cpp-python is the `--compare llama.cpp` peer).

Downloads llama-cpp-python's sdist from PyPI (the version installed here, or --version), checks
its sha256 against the index, unpacks it under --dir, installs cmake and ninja into this Python
if they are missing, and builds the `llama-server` target with llama.cpp's defaults for this CPU
(`GGML_NATIVE`), without curl or OpenSSL (loopback only). Prints the binary's path. About 7
minutes on 2 cores.

    python scripts/build_llama_server.py --dir build/llama-server
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

INDEX = "https://pypi.org/simple/llama-cpp-python/"


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.hrefs += [v for k, v in attrs if k == "href" and v]


def sdist_url(version: str) -> tuple[str, str]:
    """(URL, sha256) of llama-cpp-python's sdist at `version`, from PyPI's simple index."""
    with urllib.request.urlopen(INDEX, timeout=60) as resp:
        links = _Links()
        links.feed(resp.read().decode())
    name = f"llama_cpp_python-{version}.tar.gz"
    for href in links.hrefs:
        url, _, fragment = href.partition("#sha256=")
        if url.endswith("/" + name) and fragment:
            return url, fragment
    raise SystemExit(f"no sdist {name} with a sha256 in {INDEX}")


def download(url: str, sha256: str, to: Path) -> Path:
    path = to / url.rsplit("/", 1)[1]
    if not path.exists():
        with urllib.request.urlopen(url, timeout=600) as resp, open(path, "wb") as f:
            shutil.copyfileobj(resp, f)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        path.unlink()
        raise SystemExit(f"{path.name}: sha256 {digest}, the index says {sha256}")
    return path


def build_tools() -> dict[str, str]:
    """An environment whose PATH has cmake and ninja (pip-installed into this Python if missing)."""
    scripts = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": scripts + os.pathsep + os.environ.get("PATH", "")}
    if (
        shutil.which("cmake", path=env["PATH"]) is None
        or shutil.which("ninja", path=env["PATH"]) is None
    ):
        subprocess.run([sys.executable, "-m", "pip", "install", "cmake", "ninja"], check=True)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("build/llama-server"), help="work folder")
    ap.add_argument(
        "--version",
        default=None,
        help="llama-cpp-python version (default: the installed one)",
    )
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    version = args.version
    if version is None:
        try:
            version = importlib.metadata.version("llama-cpp-python")
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit("llama-cpp-python is not installed here: pass --version") from None
    args.dir.mkdir(parents=True, exist_ok=True)
    tarball = download(*sdist_url(version), args.dir)
    src = args.dir / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if not src.is_dir():
        with tarfile.open(tarball) as tar:
            tar.extractall(args.dir, filter="data")
    env = build_tools()
    build = src / "build"
    subprocess.run(
        [
            "cmake", "-S", str(src), "-B", str(build), "-G", "Ninja",
            "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
        ],
        check=True,
        env=env,
    )  # fmt: skip
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(args.jobs)],
        check=True,
        env=env,
    )
    print((build / "bin" / "llama-server").resolve())


if __name__ == "__main__":
    main()
