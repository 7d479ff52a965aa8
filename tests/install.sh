#!/bin/sh
# What the test suite needs: the real services it starts itself (OpenSSH, SLURM with munge),
# rsync for the benchmarks, chromium and its driver for the web page's browser tests, and
# tether with its test extras. Safe to run again.
set -e
cd "$(dirname "$0")/.."
need=""
[ -x /usr/sbin/sshd ] || need="$need openssh-server openssh-client"
command -v rsync >/dev/null 2>&1 || need="$need rsync"
[ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] || need="$need slurmctld slurmd slurm-client"
[ -x /usr/sbin/munged ] || need="$need munge"
[ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ] || need="$need chromium chromium-driver"
if [ -n "$need" ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null
fi
pip install -q -e '.[test]'
