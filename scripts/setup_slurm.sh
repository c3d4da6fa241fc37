#!/usr/bin/env bash
# Slurm for the tests in tests/slurm: Debian's slurm-wlm (slurmctld, slurmd, srun,
# sbatch, salloc, sinfo, with the pmi2 MPI plugin) and munge (the authentication
# daemon), installed with apt-get. Nothing is configured or started here: the tests
# start a private munged, slurmctld and slurmd of their own (tests/slurm/slurm_harness.py)
# with a generated slurm.conf under a temporary folder, and stop them at the end.
# A second run is a no-op when every program is already there.
#
# Needs root (or sudo) and a Debian or Ubuntu package source. Every step's output goes
# to $JAXSYNC_SLURM_LOG (default: /tmp/jaxsync-setup-slurm.log); a failed step stops
# set-up at once with a non-zero exit, the step's name and the last lines of its output.
#
# Environment (all optional):
#   JAXSYNC_SLURM_LOG       the log file (default: /tmp/jaxsync-setup-slurm.log)
#   JAXSYNC_SLURM_APT_GET   the apt-get command (default: apt-get; the tests' stand-in)
#   JAXSYNC_SLURM_PROGRAMS  more programs to require, space separated (the tests' hook
#                           to make a machine with Slurm look like one without)
#
# Use it:   bash scripts/setup_slurm.sh && .venv/bin/python -m pytest -q tests/slurm
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# shellcheck disable=SC2206
programs=(slurmctld slurmd srun sbatch salloc sinfo scontrol scancel munged mungekey
          ${JAXSYNC_SLURM_PROGRAMS:-})
apt_get="${JAXSYNC_SLURM_APT_GET:-apt-get}"
missing() {
  local p
  for p in "${programs[@]}"; do
    if ! command -v "$p" > /dev/null 2>&1 && [ ! -x "/usr/sbin/$p" ]; then echo "$p"; fi
  done
}
# The pmi2 plugin is what `srun --mpi=pmi2` loads; its absence is a broken install.
# (Looked for as a file: `srun --mpi=list` needs a slurm.conf, which only the tests write.)
pmi2_plugin() {
  ls /usr/lib/*/slurm-wlm/mpi_pmi2.so /usr/lib*/slurm-wlm/mpi_pmi2.so \
    /usr/lib*/slurm/mpi_pmi2.so /usr/local/lib*/slurm/mpi_pmi2.so 2> /dev/null | head -n 1
}
have_pmi2() { [ -n "$(pmi2_plugin)" ]; }
if [ -z "$(missing)" ] && have_pmi2; then
  exit 0
fi

tag=setup-slurm
log="${JAXSYNC_SLURM_LOG:-/tmp/jaxsync-setup-slurm.log}"
: > "$log"
started=$SECONDS
step_fix="fix the cause and run this again (bash $root/scripts/setup_slurm.sh)."
# shellcheck source=scripts/_step.sh
source "$root/scripts/_step.sh"

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo > /dev/null 2>&1; then sudo=(sudo -n); else
    echo "[$tag] FAILED: installing slurm-wlm and munge needs root; run this as root" \
      "or install sudo (missing: $(missing | tr '\n' ' '))." >&2
    exit 1
  fi
fi
if ! command -v "$apt_get" > /dev/null 2>&1; then
  echo "[$tag] FAILED: apt-get not found; this script installs Debian's slurm-wlm and" \
    "munge. Install Slurm (slurmctld, slurmd, srun with the pmi2 plugin) and munge" \
    "by hand (missing: $(missing | tr '\n' ' '))." >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
step "apt-get update" "${sudo[@]}" "$apt_get" update
step "apt-get install slurm-wlm munge (slurmctld, slurmd, srun, munged)" \
  "${sudo[@]}" "$apt_get" install -y --no-install-recommends slurm-wlm munge
check() {
  local left
  left="$(missing | tr '\n' ' ')"
  if [ -n "$left" ]; then echo "still missing after the install: $left"; return 1; fi
  have_pmi2 || { echo "no mpi_pmi2.so (srun --mpi=pmi2's plugin) in Slurm's plugin folders"; return 1; }
  echo "pmi2 plugin: $(pmi2_plugin)"
  srun -V
}
step "verify: every program is there, with the pmi2 MPI plugin" check
echo "[$tag] done in $((SECONDS - started)) s (log: $log)"
