#!/bin/sh
# What the test suite needs: the real services it starts itself (OpenSSH, SLURM with munge),
# rsync for the benchmarks, and tether with its test extras. Safe to run again.
set -e
cd "$(dirname "$0")/.."
need=""
[ -x /usr/sbin/sshd ] || need="$need openssh-server openssh-client"
command -v rsync >/dev/null 2>&1 || need="$need rsync"
[ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] || need="$need slurmctld slurmd slurm-client"
[ -x /usr/sbin/munged ] || need="$need munge"
if [ -n "$need" ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need >/dev/null
fi
pip install -q -e '.[test]'
