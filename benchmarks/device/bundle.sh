# Sourced first by every device script: the tree's root is the working directory and `.bundle`
# (made with the shared `make-bundle`: Ray and bitsandbytes, which the GPU machine lacks) was
# carried. Unpacks it and puts it, and the project, on the paths.
set -u
# (a script that needs neither, like `stepmem estimate`, may run without it)
mkdir -p /tmp/site && { [ ! -f .bundle/site.tar.xz ] || tar -xJf .bundle/site.tar.xz -C /tmp/site; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1

write_env() {  # write_env FILE: the GPU, its driver and the library versions a result was made with
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$1"
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$1"
  python -c "import ray, bitsandbytes as b; print('ray', ray.__version__, 'bitsandbytes', b.__version__)" >> "$1" 2>/dev/null || echo "(no bundle: no ray, no bitsandbytes)" >> "$1"
}

ray_head() {  # ray_head LOG: a one-GPU Ray head on loopback for `ray job submit`; the script ends if it fails
  ray start --head --num-gpus=1 --node-ip-address=127.0.0.1 --dashboard-host=127.0.0.1 \
    --disable-usage-stats > "$1" 2>&1 || { tail "$1"; exit 1; }
}
