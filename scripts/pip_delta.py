"""Compare two `pip list --format=json` snapshots of one environment taken before and after installing p2pworker.

Exit 1 when any package that was there before changed version or disappeared (p2pworker itself excepted):
installing p2pworker into a vLLM environment must leave vLLM, torch and everything else it had as they were.
Usage: python scripts/pip_delta.py BEFORE.json AFTER.json

The two vLLM builds we test both ship a torch that p2pworker's requirements accept, so they cannot show what happens
in an image with a newer torch.  For that, scripts/setup.sh plants a stand-in distribution of a version no
requirement anticipates (a bare .dist-info: pip treats it as installed) and asks pip what it would install:
  --fake-dist VENV NAME VERSION    plant NAME==VERSION as installed in VENV (the running interpreter's own venv)
  --would-install REPORT NAME      exit 1 if pip's `install --dry-run --report` REPORT would install NAME
  --pip-conf-without-constraint OUT  pip's configuration (files, not environment) as one file, minus `constraint`
"""

from __future__ import annotations

import json
import sys

OURS = {"p2pworker"}


def load(path: str) -> dict[str, str]:
    with open(path) as f:
        return {p["name"].lower().replace("_", "-"): p["version"] for p in json.load(f)}


def main(before_path: str, after_path: str) -> int:
    before, after = load(before_path), load(after_path)
    changed = {n: (v, after.get(n)) for n, v in before.items() if n not in OURS and after.get(n) != v}
    added = sorted(f"{n}=={after[n]}" for n in after.keys() - before.keys() if n not in OURS)
    if changed:
        for n, (old, new) in sorted(changed.items()):
            print(f"pip_delta: {n} {old} -> {new or 'removed'}", file=sys.stderr)
        print(f"pip_delta: installing p2pworker changed {len(changed)} package(s) the environment already had",
              file=sys.stderr)
        return 1
    print(f"unchanged: {len(before)} packages; added: {', '.join(added) or 'nothing'}")
    return 0


def fake_dist(venv: str, name: str, version: str) -> int:
    import sysconfig
    from pathlib import Path

    site = Path(sysconfig.get_paths()["purelib"])
    if not site.is_relative_to(Path(venv).resolve()) and not site.is_relative_to(Path(venv)):
        print(f"pip_delta: run --fake-dist with {venv}'s own python (this one installs into {site})", file=sys.stderr)
        return 2
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip_delta\n")
    (info / "RECORD").write_text("")
    return 0


def would_install(report_path: str, name: str) -> int:
    with open(report_path) as f:
        report = json.load(f)
    wanted = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report.get("install", [])}
    if name.lower() in wanted:
        print(f"pip_delta: installing p2pworker would replace the installed {name} with {name}=={wanted[name]}",
              file=sys.stderr)
        return 1
    print(f"pip_delta: a newer {name} stays; pip would add {', '.join(sorted(wanted)) or 'nothing'}")
    return 0


def pip_conf_without_constraint(out: str) -> int:
    """Write pip's effective file settings (``pip config list``: index URLs, find-links, certificates) to ``out``
    with an empty ``constraint``: a file to use as PIP_CONFIG_FILE, which pip then loads instead of the user's."""
    import ast
    import configparser
    import subprocess

    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    conf = configparser.ConfigParser(interpolation=None)
    for line in listed.splitlines():
        name, sep, value = line.partition("=")
        if not sep or name.startswith(":env:"):  # the environment still applies on its own
            continue
        section, _, key = name.partition(".")
        if key == "constraint":
            continue
        if not conf.has_section(section):
            conf.add_section(section)
        conf.set(section, key, ast.literal_eval(value))
    if not conf.has_section("global"):
        conf.add_section("global")
    conf.set("global", "constraint", "")
    with open(out, "w") as f:
        conf.write(f)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--pip-conf-without-constraint"]:
        sys.exit(pip_conf_without_constraint(sys.argv[2]))
    if sys.argv[1:2] == ["--fake-dist"]:
        sys.exit(fake_dist(*sys.argv[2:5]))
    if sys.argv[1:2] == ["--would-install"]:
        sys.exit(would_install(*sys.argv[2:4]))
    sys.exit(main(*sys.argv[1:3]))
