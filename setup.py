"""Installs the repository's top-level runtime folders as subpackages of one package, `hybridpd`.

The repository keeps `engine/`, `proxy/`, ... at its top level; the installed distribution has only `hybridpd`
(`hybridpd.engine`, `hybridpd.proxy`, ...), so it never shadows another project's `engine` or `proxy`. Everything
else about the project is in pyproject.toml.
"""

from setuptools import find_packages, setup

RUNTIME = ("engine", "prefill", "decode", "kvtransfer", "proto", "proxy", "deploy", "worker")

packages = ["hybridpd"]
package_dir = {"hybridpd": "hybridpd"}
for top in RUNTIME:
    for sub in [top] + [f"{top}.{p}" for p in find_packages(top)]:
        name = f"hybridpd.{sub}"
        packages.append(name)
        package_dir[name] = sub.replace(".", "/")

setup(packages=packages, package_dir=package_dir)
