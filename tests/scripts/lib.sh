# Shared by the test bed's install scripts (tools.sh, guest.sh, node-tools.sh); sourced, not run.
# The caller defines `say`.

# install_debs [APT-GET-INSTALL-OPTIONS...] -- PACKAGE...: installs the Debian packages that are not
# installed yet (as root; otherwise it says which are missing and fails), with one `apt-get update`
# first, and says how long it took.
install_debs() {
  local opts=() missing=() p start
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do opts+=("$1"); shift; done
  shift
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    say "missing Debian packages ${missing[*]} and not root: install them with apt-get" >&2
    return 1
  fi
  say "apt-get install ${opts[*]} ${missing[*]}"
  start=$(date +%s)
  apt_update_once
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${opts[@]}" "${missing[@]}" >/dev/null
  say "installed ${missing[*]} in $(( $(date +%s) - start ))s"
}

# apt_update_once: `apt-get update` once per script run (apt-cache look-ups need it on a new
# machine too).
apt_update_once() {
  [ -n "${APT_UPDATED:-}" ] && return 0
  apt-get update -qq >/dev/null
  APT_UPDATED=1
}
