#!/bin/sh
# Installs the host packages atoll's local worker needs (Debian 12, as root) when any is missing.
# Called by `make run` / `make test` before the Python environment is set up.
set -eu
need=""
command -v runsc >/dev/null 2>&1 || need="$need runsc"
command -v mmdebstrap >/dev/null 2>&1 || need="$need mmdebstrap"
command -v ip >/dev/null 2>&1 || need="$need iproute2"
command -v mkfs.ext4 >/dev/null 2>&1 || need="$need e2fsprogs"
command -v unshare >/dev/null 2>&1 || need="$need util-linux"
command -v nft >/dev/null 2>&1 || need="$need nftables"
# The worker compiles atoll-init (src/atoll/guest/init, static: libc6-dev's libc.a) at start, and the
# template build atoll's compatibility shim (src/atoll/worker/images/compat), with the host's gcc.
command -v gcc >/dev/null 2>&1 || need="$need gcc"
[ -e /usr/include/stdio.h ] && [ -n "$(gcc -print-file-name=libc.a 2>/dev/null | grep /)" ] || need="$need libc6-dev"
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need="$need python3-venv"
# The tests keep the records in PostgreSQL too (atoll.testing.postgres runs initdb and postgres from
# here, as the package's `postgres` user); atoll itself needs it only with a postgresql:// URL.
{ ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && id postgres >/dev/null 2>&1; } || need="$need postgresql"
if [ -n "$need" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "atoll: missing host packages:$need — run as root (apt-get install$need)" >&2
    exit 1
  fi
  echo "atoll: installing host packages:$need" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null
fi
