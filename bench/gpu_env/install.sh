#!/usr/bin/env bash
# On the GPU machine, after every .gpu32/cNN was moved into /tmp/wh32: reassemble the split wheels,
# check them against SHA256SUMS, install everything into /tmp/site32 (the image's torch 2.11 stays
# untouched) and show what `PYTHONPATH=/tmp/site32 python3` then imports.
# Afterwards: export PYTHONPATH=/tmp/site32 PATH=/tmp/site32/bin:$PATH
set -euo pipefail
W=/tmp/wh32 T=/tmp/site32
cd "$W"
for first in *.whl.part00; do
  [ -e "$first" ] || continue
  w=${first%.part00}
  cat "$w".part[0-9][0-9] > "$w.tmp" && mv "$w.tmp" "$w" && rm -f "$w".part[0-9][0-9]
done
[ -f SHA256SUMS ] || { echo "no SHA256SUMS in $W: a chunk is missing (check with ls $W)"; exit 1; }
# cuBLAS, cuDNN and cuSPARSELt are sent last and may be left out: the image's own then serve
# (prepare.sh). A part of one without the rest is left out too.
late='nvidia_cublas-|nvidia_cudnn_cu13-|nvidia_cusparselt_cu13-'
rm -f $(ls | grep -E "^($late).*\.part[0-9][0-9]$" || true)
missing=$(awk '{print $2}' SHA256SUMS | while read -r w; do [ -f "$w" ] || echo "$w"; done)
if echo "$missing" | grep -v '^$' | grep -qvE "^($late)"; then
  echo "wheels missing: $(echo "$missing" | grep -vE "^($late)" | tr '\n' ' ')- send those chunks again"; exit 1
fi
[ -z "$missing" ] || echo "left out, the image's own used: $(echo "$missing" | tr '\n' ' ')"
if ! sha256sum --quiet --ignore-missing -c SHA256SUMS; then echo "wheels damaged: send those chunks again"; exit 1; fi
if [ -d "$T"/vllm-0.32.0.dist-info ] && [ -d "$T"/torch-2.13.0.dist-info ]; then
  # late wheels sent after a first install: add them
  new=$(for w in "$W"/*.whl; do n=$(basename "$w" | cut -d- -f1-2); ls -d "$T/$n".dist-info > /dev/null 2>&1 || echo "$w"; done)
  [ -z "$new" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T" $new
  echo "$T installed"
else
  rm -rf "$T"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$T" "$W"/*.whl
fi
PYTHONPATH=$T python3 -c 'import torch, vllm; print(torch.__version__, torch.version.cuda, vllm.__version__)'
PYTHONPATH=$T python3 - <<'EOF'
import importlib.metadata as md, re, torch
from packaging.specifiers import SpecifierSet
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
print("AsyncLLM import ok")
x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize(); (x @ x).sum().item()
print("cuda ok:", torch.cuda.get_device_name(0), "| torch CUDA", torch.version.cuda,
      "| cudnn", torch.backends.cudnn.version(), "| nccl", torch.cuda.nccl.version())
libs = sorted({l.split()[-1] for l in open("/proc/self/maps")
               if re.search(r"lib(cublas|cudnn|nccl|cusparseLt|cudart)\.so", l)})
print("loaded:", *libs, sep="\n  ")
# what the image is trusted to have (not carried): versions vllm 0.32 asks for
want = {"requests": ">=2.33.0", "pillow": ">=12.3.0", "aiohttp": ">=3.14.3", "filelock": ">=3.20.3",
        "setuptools": ">=78.1.1,<81", "opencv-python-headless": ">=4.13.0", "huggingface-hub": ">=1.31.0",
        "cuda-bindings": "~=13.4.4", "cuda-core": ">=1.0,<2", "cuda-pathfinder": ">=1.5.4",
        "typing-extensions": ">=4.16.0", "protobuf": ">=6.33.5", "numba": "", "torchaudio": "==2.11.0"}
for name, spec in want.items():
    try:
        v = md.version(name)
    except md.PackageNotFoundError:
        print(f"WARN {name}: not installed"); continue
    if spec and v not in SpecifierSet(spec, prereleases=True):
        print(f"WARN {name} {v} (vllm 0.32 set wants {spec})")
EOF
