#!/usr/bin/env bash
# Install the Debian packages the test suite and the demo need, when missing.
# Idempotent and quiet when everything is present; needs root to install.
set -euo pipefail

# package -> a file that proves it is installed
declare -A NEED=(
  [postgresql-15]=/usr/lib/postgresql/15/bin/postgres
  [mariadb-server]=/usr/sbin/mariadbd
  # the cluster tests start a private standalone ZooKeeper (tests/fix_zk.py)
  [zookeeper]=/usr/share/java/zookeeper.jar
)

missing=()
for pkg in "${!NEED[@]}"; do
  [ -e "${NEED[$pkg]}" ] || missing+=("$pkg")
done
# the Spark source's tests run a local Spark (pyspark), which needs a Java 17+
# runtime; any java on PATH will do, else Debian's headless JRE
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "missing system packages: ${missing[*]} (run as root, or: sudo apt-get install ${missing[*]})" >&2
  exit 1
fi
echo "installing system packages: ${missing[*]}"
# keep package post-install scripts from starting services of their own
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
