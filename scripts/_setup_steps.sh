# Shared by scripts/setup.sh and scripts/setup_ft.sh (sourced): the log, and `step`
# (scripts/_step.sh).
# Needs $venv and $tag (the prefix of every line, e.g. "setup") set by the caller.

mkdir -p "$venv"
rm -f "$stamp"                      # written again only after the final check
log="$venv/setup.log"
: > "$log"
started=$SECONDS

step_fix="nothing was marked done; fix the cause and run this again."
# shellcheck source=scripts/_step.sh
source "$(dirname "${BASH_SOURCE[0]}")/_step.sh"

pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
