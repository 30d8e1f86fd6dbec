"""Print the versions a stack imports; exit 1 unless they are the ones its name promises.

    python .ci/versions.py torch=2.15.0 torchtitan=0.3.0
    python .ci/versions.py torch=2.14.1 torchtitan=none
    python .ci/versions.py python=3.12 torch=2.11.0

A local build tag (``2.15.0+cu132``) matches its release (``2.15.0``), and a
release its major.minor (``3.12.1`` is ``3.12``); ``none`` means the package
must not be installed.
"""

import importlib.metadata
import platform
import sys


def installed(name: str) -> str:
    if name == "python":
        return platform.python_version()
    if name == "torch":
        import torch  # the version torch reports, not the metadata pip left behind

        return torch.__version__
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def main(expected: list[str]) -> int:
    wrong = []
    for spec in expected:
        name, want = spec.split("=")
        got = installed(name)
        print(f"stack: {name} {got}")
        release = got.split("+")[0]
        if release != want and not release.startswith(want + "."):
            named = "no " + name if want == "none" else f"{name} {want}"
            wrong.append(f"{name} {got}, where this stack is named for {named}")
    if wrong:
        print("stack: WRONG VERSIONS: " + "; ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
