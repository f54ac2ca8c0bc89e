#!/usr/bin/env bash
# Prepares vLLM 0.32.0 + torch 2.13.0 (cu130) and what they need beyond the GPU machine's image
# (wheels-0.32.0.txt) as chunks of at most 48 MiB, each sent to the GPU machine on its own.
# Run from the project root on this machine: bash bench/gpu_env/prepare.sh
# Output (git-ignored): .gpu32/all/ (the wheels), .gpu32/c00 .. .gpu32/cNN (what travels),
# .gpu32/install.sh. Idempotent: wheels already in .gpu32/all/ are not downloaded again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
list="$here/wheels-0.32.0.txt"
[ -d .git ] || { echo "run from the project root" >&2; exit 1; }
grep -qx '/.gpu32/' .git/info/exclude 2>/dev/null || echo '/.gpu32/' >> .git/info/exclude
mkdir -p .gpu32/all

# The public index only: this machine's pip config adds local wheel dirs and a torch cap.
export PIP_CONFIG_FILE=/dev/null
unset PIP_FIND_LINKS PIP_EXTRA_INDEX_URL PIP_CONSTRAINT 2>/dev/null || true
plat=(--platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64
      --platform manylinux2014_x86_64)
for v in 5 12 $(seq 17 35); do plat+=(--platform "manylinux_2_${v}_x86_64"); done

# which requirements have no wheel in .gpu32/all yet
missing=$(python3 - "$list" <<'EOF'
import os, re, sys
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
have = {(norm(f.split("-")[0]), f.split("-")[1]) for f in os.listdir(".gpu32/all") if f.endswith(".whl")}
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, ver = line.split("==")
        if (norm(name), ver) not in have:
            print(line)
EOF
)
if [ -n "$missing" ]; then
  echo "downloading $(echo "$missing" | wc -l) wheels into .gpu32/all ..."
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${plat[@]}" --index-url https://pypi.org/simple \
    -d .gpu32/all $missing
fi

# chunks: a wheel over 48 MiB is cut into 48 MiB parts (<wheel>.partNN, the full parts one chunk each);
# the rest (last parts and whole wheels) is packed first-fit-decreasing into chunks of at most 48 MiB.
# 48, not more: a chunk plus the working tree (~9 MiB) must stay under the 64 MiB a call carries.
rm -rf .gpu32/c[0-9]* .gpu32/install.sh
python3 - "$list" <<'EOF'
import hashlib, os, re, shutil, sys
LIMIT = 48 * 1024 * 1024
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
files = {(norm(f.split("-")[0]), f.split("-")[1]): f for f in os.listdir(".gpu32/all") if f.endswith(".whl")}
wheels = []
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if line:
        name, ver = line.split("==")
        f = files.get((norm(name), ver))
        if f is None:
            sys.exit(f"no wheel for {line} in .gpu32/all")
        wheels.append(f)
# Sent last, and only if the image's own (cuBLAS 13.1.0.3, cuDNN 9.19, cuSPARSELt 0.8.0: same sonames,
# one minor or patch release older than torch 2.13's pins) do not serve: install.sh runs without them.
LATE = {"nvidia_cublas", "nvidia_cudnn_cu13", "nvidia_cusparselt_cu13"}
chunks, items = [], []          # items: (size, name, source path, offset)
late_chunks, late_items = [], []
sums = []
for f in wheels:
    p = os.path.join(".gpu32/all", f)
    size = os.path.getsize(p)
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for b in iter(lambda: fh.read(1 << 22), b""):
            h.update(b)
    sums.append(f"{h.hexdigest()}  {f}\n")
    late = norm(f.split("-")[0]) in LATE
    whole, loose = (late_chunks, late_items) if late else (chunks, items)
    if size <= LIMIT:
        loose.append((size, f, p, None))
        continue
    n = 0
    for off in range(0, size, LIMIT):
        part = min(LIMIT, size - off)
        entry = (part, f"{f}.part{n:02d}", p, off)
        (whole.append([entry]) if part == LIMIT else loose.append(entry))
        n += 1
sums_text = "".join(sums).encode()
items.append((len(sums_text), "SHA256SUMS", None, None))
def pack(loose):
    bins = []
    for it in sorted(loose, key=lambda x: -x[0]):
        for b in bins:
            if sum(x[0] for x in b) + it[0] <= LIMIT:
                b.append(it)
                break
        else:
            bins.append([it])
    return bins
chunks += pack(items)
print(f"chunks c{len(chunks):02d} and after: the image-replaceable libraries ({', '.join(sorted(LATE))})")
chunks += late_chunks + pack(late_items)
for i, chunk in enumerate(chunks):
    d = f".gpu32/c{i:02d}"
    os.makedirs(d)
    for size, name, src, off in chunk:
        dst = os.path.join(d, name)
        if src is None:
            open(dst, "wb").write(sums_text)
        elif off is None:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        else:
            with open(src, "rb") as fi, open(dst, "wb") as fo:
                fi.seek(off)
                fo.write(fi.read(size))
    assert sum(os.path.getsize(os.path.join(d, x)) for x in os.listdir(d)) <= LIMIT
EOF
cp "$here/install.sh" .gpu32/install.sh
n=$(ls -d .gpu32/c[0-9]* | wc -l)
for d in .gpu32/c[0-9]*; do
  printf '  %s  %6.1f MiB  %s\n' "$d" "$(du -b "$d" | awk '{print $1/1048576}')" "$(ls "$d" | sed 's/-[0-9].*\.whl\(\.part\)\?/\1/' | tr '\n' ' ' | cut -c1-90)"
done
total=$(du -cb .gpu32/c[0-9]* | tail -1 | awk '{print $1}')
echo "$n chunks, $(awk -v t="$total" 'BEGIN{printf "%.0f MiB (%.2f GB)", t/1048576, t/1e9}') in all, $(grep -c '^[^#].*==' "$list") wheels"
echo "send each .gpu32/cNN on its own, back to back: carry [\".gpu32/cNN\"], run: mkdir -p /tmp/wh32 && mv .gpu32/cNN/* /tmp/wh32/"
echo "then: carry [\".gpu32/install.sh\"], run: bash .gpu32/install.sh  (afterwards PYTHONPATH=/tmp/site32)"
